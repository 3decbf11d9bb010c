"""Integration test: Triton's GPU metrics (nv_gpu_*, nv_energy_consumption)
on a CPU moed. With the test's fake NVML library offered
(MOED_NVML_LIBRARY, built next to moed as libmoed_fake_nvml.so) a moed
without GPU workers writes no GPU metric and no error, never opens the
library, and says why at debug level; so does --allow-gpu-metrics=false
(Triton's spelling); a bad value for the flag stops moed naming it. The
exposition lines themselves are checked against the same fake library,
with two GPUs, in tests/unit/server/test_gpu_metrics.c.

env: MOED."""
import os
import subprocess
import sys
import tempfile
import urllib.request

sys.path.insert(0, os.path.dirname(__file__))
import test_server as ts  # noqa: E402
from test_server import check  # noqa: E402

FAKE = os.path.join(os.path.dirname(ts.MOED), "libmoed_fake_nvml.so")


def scrape(tmp, *flags):
    """/metrics of a CPU moed started with flags; (text, moed's log, whether the fake library was mapped)."""
    log = os.path.join(tmp, "moed.log")
    open(log, "w").close()
    p, _, http_port = ts.start(tmp, "--device", "cpu", "--log-level", "debug", *flags)
    try:
        r = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10)
        text = r.read().decode()
        check(r.status == 200, f"{flags}: /metrics 200 ({r.status})")
        mapped = FAKE in open(f"/proc/{p.pid}/maps").read()
    finally:
        ts.stop(p)
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


def main():
    check(os.path.exists(FAKE), f"the fake NVML library is built next to moed ({FAKE})")
    os.environ["MOED_NVML_LIBRARY"] = FAKE
    with tempfile.TemporaryDirectory() as tmp:
        no_gpu_metrics(tmp, (), "no GPU workers")
        no_gpu_metrics(tmp, ("--allow-gpu-metrics=false",), "--allow-gpu-metrics false")
        no_gpu_metrics(tmp, ("--allow-gpu-metrics", "0"), "--allow-gpu-metrics false")
        r = subprocess.run([ts.MOED, "--allow-gpu-metrics", "maybe"], capture_output=True, text=True, timeout=30)
        check(r.returncode != 0 and "'maybe' for --allow-gpu-metrics" in r.stderr,
              f"a bad --allow-gpu-metrics value names the flag ({r.returncode}: {r.stderr.strip()})")
        ts.print_log_tail(tmp)
    ts.exit_with_summary()


if __name__ == "__main__":
    main()
