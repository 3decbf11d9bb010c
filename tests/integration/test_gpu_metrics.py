"""Integration test: Triton's GPU metrics (nv_gpu_*, nv_energy_consumption)
on a CPU moed. With the test's fake NVML library offered
(MOED_NVML_LIBRARY, built next to moed as libmoed_fake_nvml.so) a moed
without GPU workers writes no GPU metric and no error, never opens the
library, and says why at debug level; so does --allow-gpu-metrics=false
(Triton's spelling); a bad value for the flag stops moed naming it. The
exposition lines themselves are checked against the same fake library,
with two GPUs, in tests/unit/server/test_gpu_metrics.c; here Triton's
perf_analyzer --collect-metrics (the release the suite pins) reads that
text (test_gpu_metrics --print) and reports each GPU's values.

On a machine with the NVIDIA driver (libnvidia-ml.so.1 loads) and a GPU
build of moed, the real path too: `moed --device gpu` writes each of the six
metrics once per GPU worker (as many as moed_device_memory_bytes{kind="held"}
samples), for GPUs NVML knows, total memory and power limit as NVML reads
them here through ctypes, used <= total, utilization in [0, 1], energy not
decreasing between scrapes; the log names each worker's NVML UUID; with
--allow-gpu-metrics false there are none. Elsewhere that part says it is
skipped.

env: MOED, MOE_MKSET (read by test_perf_analyzer, whose perf_analyzer runner this uses)."""
import ctypes
import http.server
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(__file__))
from moed_process import MOED, StartFailed, check, exit_with_summary, moed, print_log_tail  # noqa: E402
from test_perf_analyzer import PA, perf_analyzer  # noqa: E402

FAKE = os.path.join(os.path.dirname(MOED), "libmoed_fake_nvml.so")
PRINT = os.path.join(os.path.dirname(MOED), "test_gpu_metrics")


def scrape(tmp, *flags):
    """/metrics of a CPU moed started with flags; (text, moed's log, whether the fake library was mapped)."""
    log = os.path.join(tmp, "moed.log")
    open(log, "w").close()
    with moed(tmp, "--device", "cpu", "--log-level", "debug", *flags) as (p, _, http_port):
        r = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10)
        text = r.read().decode()
        check(r.status == 200, f"{flags}: /metrics 200 ({r.status})")
        mapped = FAKE in open(f"/proc/{p.pid}/maps").read()
    return text, open(log).read(), mapped


def no_gpu_metrics(tmp, flags, why):
    text, log, mapped = scrape(tmp, *flags)
    gpu_lines = [l for l in text.splitlines() if "nv_gpu_" in l or "nv_energy_consumption" in l]
    check(gpu_lines == [], f"{flags or 'defaults'}: no GPU metric lines ({gpu_lines[:3]})")
    check("nv_inference_count" in text and "moed_ready 1" in text, f"{flags}: the rest of /metrics is there")
    check(not mapped, f"{flags}: the NVML library was never opened")
    lines = [l for l in log.splitlines() if "gpu_metrics" in l]
    check(len(lines) == 1 and f"debug gpu_metrics: off: {why}" in lines[0],
          f"{flags}: one debug line says why ({lines})")
    check(not [l for l in log.splitlines() if " error " in l], "no error in the log")


def collect_metrics(tmp):
    """perf_analyzer --collect-metrics on a CPU moed, its metrics URL serving gpu_metrics.c's text for the
    fake NVML's two GPUs (values in fake_nvml.c): the GPU section lists both, as Triton's are listed."""
    if not os.access(PA, os.X_OK):
        check(False, f"perf_analyzer at {PA} (run scripts/deps.sh)")
        return
    r = subprocess.run([PRINT, "--print"], capture_output=True, timeout=30)
    check(r.returncode == 0 and r.stdout.startswith(b"# HELP nv_gpu_utilization"),
          f"test_gpu_metrics --print ({r.returncode}: {r.stderr[-300:]})")
    body = r.stdout

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with moed(tmp, "--device", "cpu") as (_, port, _):
            r = perf_analyzer(port, "quant.per_token", "--shape", "x:4,64", "--collect-metrics", "--metrics-url",
                              f"127.0.0.1:{srv.server_address[1]}/metrics", "--metrics-interval", "100")
    finally:
        srv.shutdown()
    out = r.stdout + r.stderr
    u0, u1 = "GPU-11111111-2222-3333-4444-000000000000", "GPU-55555555-6666-7777-8888-000000000001"
    want = [f"{u0} : 37%", f"{u1} : 100%", f"{u0} : 123.456 watts", f"{u0} : 1073741824 bytes",
            f"{u1} : 0 bytes", f"{u1} : 150754820096 bytes"]
    check(r.returncode == 0 and all(w in out for w in want) and "Unable to parse" not in out,
          f"perf_analyzer --collect-metrics reads every GPU's values ({r.returncode}: "
          f"{out[out.find('Server Prometheus'):][:700]})")


FAMILIES = ["nv_gpu_utilization", "nv_gpu_memory_total_bytes", "nv_gpu_memory_used_bytes", "nv_gpu_power_usage",
            "nv_gpu_power_limit", "nv_energy_consumption"]
SAMPLE = re.compile(r'^(\w+)\{(\w+)="([^"]*)"(?:,.*)?\} (\S+)$')


def samples(text):
    """{family: {first label value: value}} of the GPU families and moed_device_memory_bytes."""
    out = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m and (m.group(1) in FAMILIES or (m.group(1) == "moed_device_memory_bytes" and 'kind="held"' in line)):
            out.setdefault(m.group(1), {})[m.group(3)] = float(m.group(4))
    return out


def nvml_devices():
    """{uuid: (total memory bytes, power limit W)} as NVML says, or None without the driver's library."""
    try:
        nv = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None

    class Memory(ctypes.Structure):  # nvmlMemory_t
        _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

    check(nv.nvmlInit_v2() == 0, "nvmlInit_v2 in the test")
    n = ctypes.c_uint()
    check(nv.nvmlDeviceGetCount_v2(ctypes.byref(n)) == 0, "nvmlDeviceGetCount_v2")
    out = {}
    for i in range(n.value):
        h, uuid, mem, limit = ctypes.c_void_p(), ctypes.create_string_buffer(96), Memory(), ctypes.c_uint()
        if (nv.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(h)) == 0 and nv.nvmlDeviceGetUUID(h, uuid, 96) == 0
                and nv.nvmlDeviceGetMemoryInfo(h, ctypes.byref(mem)) == 0):
            ok = nv.nvmlDeviceGetPowerManagementLimit(h, ctypes.byref(limit)) == 0
            out[uuid.value.decode()] = (mem.total, limit.value / 1000 if ok else None)
    return out


def real_nvml(tmp):
    devices = nvml_devices()
    if devices is None:
        print("skip real NVML: no libnvidia-ml.so.1 here (not a GPU machine)")
        return
    os.environ.pop("MOED_NVML_LIBRARY", None)
    log = os.path.join(tmp, "moed.log")
    open(log, "w").close()
    try:
        with moed(tmp, "--device", "gpu") as (_, _, http_port):
            url = f"http://127.0.0.1:{http_port}/metrics"
            first = samples(urllib.request.urlopen(url, timeout=10).read().decode())
            time.sleep(1)
            second = samples(urllib.request.urlopen(url, timeout=10).read().decode())
    except StartFailed:
        print("skip real NVML: moed --device gpu did not start (a CPU build?):", open(log).read()[-500:])
        return
    workers = len(first.get("moed_device_memory_bytes", {}))
    uuids = set(first.get("nv_gpu_memory_total_bytes", {}))
    check(workers > 0 and len(uuids) == workers and uuids <= set(devices),
          f"one sample per GPU worker, GPUs NVML knows ({workers} workers, {sorted(uuids)})")
    for fam in FAMILIES[:2] + FAMILIES[4:]:  # power usage: some boards do not report it
        check(set(first.get(fam, {})) == uuids, f"{fam}: every GPU ({first.get(fam)})")
    for u in uuids:
        total, limit = devices[u]
        check(first["nv_gpu_memory_total_bytes"][u] == total, f"{u}: total memory as NVML reads it ({total})")
        check(0 <= first["nv_gpu_memory_used_bytes"][u] <= total, f"{u}: used <= total")
        check(0 <= first["nv_gpu_utilization"][u] <= 1, f"{u}: utilization in [0, 1]")
        check(limit is None or first["nv_gpu_power_limit"][u] == limit, f"{u}: power limit as NVML reads it ({limit})")
        check(second["nv_energy_consumption"][u] >= first["nv_energy_consumption"][u] >= 0,
              f"{u}: energy counted up from start ({first['nv_energy_consumption'][u]}, "
              f"{second['nv_energy_consumption'][u]})")
    text = open(log).read()
    check(len(re.findall(r"info  gpu_metrics: worker \d+ \(gpu\d+: .*\): NVML GPU-", text)) == workers,
          "the log names each worker's NVML UUID")
    with moed(tmp, "--device", "gpu", "--allow-gpu-metrics", "false") as (_, _, http_port):
        text = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10).read().decode()
    check("nv_gpu_" not in text and "nv_energy" not in text, "real NVML, --allow-gpu-metrics false: none")


def main():
    check(os.path.exists(FAKE), f"the fake NVML library is built next to moed ({FAKE})")
    os.environ["MOED_NVML_LIBRARY"] = FAKE
    with tempfile.TemporaryDirectory() as tmp:
        no_gpu_metrics(tmp, (), "no GPU workers")
        no_gpu_metrics(tmp, ("--allow-gpu-metrics=false",), "--allow-gpu-metrics false")
        no_gpu_metrics(tmp, ("--allow-gpu-metrics", "0"), "--allow-gpu-metrics false")
        r = subprocess.run([MOED, "--allow-gpu-metrics", "maybe"], capture_output=True, text=True, timeout=30)
        check(r.returncode != 0 and "'maybe' for --allow-gpu-metrics" in r.stderr,
              f"a bad --allow-gpu-metrics value names the flag ({r.returncode}: {r.stderr.strip()})")
        collect_metrics(tmp)
        real_nvml(tmp)
        print_log_tail(tmp)
    exit_with_summary()


if __name__ == "__main__":
    main()
