"""Integration test: `moec bench` against a real moed on a free loopback port.

Short runs (about a second each) on a quant op and on fused_moe over a small
moe-mkset expert set; the JSON report must be self-consistent (requests > 0,
no errors, ok == requests, p50 <= p90 <= p99 <= max); a wrong model name is
counted by status with exit 1; --stream (ModelStreamInfer) likewise; bad flags exit 2 naming the flag. Nothing
here depends on the machine's speed beyond "some requests complete".

env: MOED, MOEC, MOE_LIB, MOE_MKSET."""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import test_server as ts  # noqa: E402  (start, check)
from test_server import check  # noqa: E402

MOEC, MKSET = os.environ["MOEC"], os.environ["MOE_MKSET"]


def bench(port, *args, json_out=True):
    cmd = [MOEC, "-a", f"127.0.0.1:{port}", "bench", *args] + (["--json"] if json_out else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    rep = None
    if json_out and r.stdout.strip():
        try:
            rep = json.loads(r.stdout)
        except ValueError:
            pass
    return r, rep


def consistent(rep, what):
    """The report of a run where every request succeeded."""
    if rep is None:
        check(False, f"{what}: a JSON report")
        return
    lat = rep["latency_ms"]
    check(rep["requests"] > 0 and rep["ok"] == rep["requests"] and rep["errors"] == 0 and
          rep["errors_by_status"] == {}, f"{what}: requests > 0, all ok ({rep['requests']}, {rep['errors']})")
    check(0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"], f"{what}: p50 <= p90 <= p99 <= max ({lat})")
    check(rep["requests_per_s"] > 0 and rep["sent_bytes_per_s"] > 0 and rep["received_bytes_per_s"] > 0,
          f"{what}: rates > 0")


def test_quant(port, tmp):
    r, rep = bench(port, "-m", "quant.per_tensor", "--input", "x=random:4x1024:FP32", "--param",
                   "out_dtype=fp8_e4m3fn", "--concurrency", "4", "--channels", "2", "--duration", "1",
                   "--warmup", "0.2")
    check(r.returncode == 0, f"quant closed loop exits 0 ({r.returncode}: {r.stderr.strip()})")
    consistent(rep, "quant closed loop")
    if rep:
        check(rep["request_bytes"] > 4 * 1024 * 4 and rep["concurrency"] == 4 and rep["channels"] == 2,
              f"quant: request bytes and the load echoed ({rep['request_bytes']})")
    # a fixed count, from a .npy file the client reads as for infer
    x = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32)
    np.save(os.path.join(tmp, "x.npy"), x)
    r, rep = bench(port, "-m", "quant.per_token", "--input", f"x={tmp}/x.npy", "--requests", "40",
                   "--concurrency", "2", "--warmup", "0")
    check(r.returncode == 0 and rep is not None and rep["requests"] == 40,
          f"--requests 40 from a .npy input: exactly 40 ({r.stderr.strip()})")
    consistent(rep, "quant --requests")
    # open loop: the schedule decides the count, not the server's speed
    r, rep = bench(port, "-m", "quant.per_tensor", "--input", "x=random:1x256:FP32", "--rate", "100",
                   "--duration", "1", "--warmup", "0.2")
    check(r.returncode == 0 and rep is not None and rep["mode"] == "open" and 80 <= rep["requests"] <= 120,
          f"open loop at 100/s for 1 s: about 100 requests ({rep and rep['requests']}: {r.stderr.strip()})")
    consistent(rep, "quant open loop")
    r, _ = bench(port, "-m", "quant.per_tensor", "--input", "x=random:2x64:FP32", "--requests", "10",
                 "--warmup", "0", json_out=False)
    check(r.returncode == 0 and "requests/s" in r.stdout and "p99" in r.stdout,
          f"the table names requests/s and p99 ({r.stdout.strip()})")


def test_fused_moe(port):
    r, rep = bench(port, "-m", "set", "--input", "hidden_states=random:4x128:BF16", "--input",
                   "router_logits=random:4x8:FP32", "--concurrency", "2", "--duration", "1", "--warmup", "0.2")
    check(r.returncode == 0, f"fused_moe expert set exits 0 ({r.returncode}: {r.stderr.strip()})")
    consistent(rep, "fused_moe expert set")


def test_stream(port):
    """--stream: ModelStreamInfer, one stream per request in flight."""
    r, rep = bench(port, "-m", "set", "--input", "hidden_states=random:2x128:BF16", "--input",
                   "router_logits=random:2x8:FP32", "--stream", "--concurrency", "3", "--channels", "2",
                   "--duration", "1", "--warmup", "0.2")
    check(r.returncode == 0 and rep is not None and rep["stream"] is True,
          f"--stream on an expert set exits 0 ({r.returncode}: {r.stderr.strip()})")
    consistent(rep, "--stream expert set")
    r, rep = bench(port, "-m", "quant.per_tensor", "--input", "x=random:1x64:FP32", "--stream", "--requests", "30",
                   "--concurrency", "2", "--warmup", "0")
    check(r.returncode == 0 and rep is not None and rep["requests"] == 30, "--stream --requests 30: exactly 30")
    # a stream's error reaches the client as a message only: counted UNKNOWN, the stream goes on
    r, rep = bench(port, "-m", "no-such-model", "--input", "x=random:1x64:FP32", "--stream", "--requests", "20",
                   "--warmup", "0")
    check(r.returncode == 1 and rep is not None and rep["errors_by_status"] == {"UNKNOWN": 20} and
          "not found" in rep.get("first_error", ""), f"--stream, a wrong model: 20 errors, exit 1 ({rep})")
    r, _ = bench(port, "-m", "quant.per_tensor", "--input", "x=random:1x64:FP32", "--stream", "--timeout-ms", "100")
    check(r.returncode == 2 and "--timeout-ms" in r.stderr, f"--stream with --timeout-ms: exit 2 ({r.stderr.strip()})")


def test_errors(port):
    r, rep = bench(port, "-m", "no-such-model", "--input", "x=random:1x64:FP32", "--duration", "0.5",
                   "--warmup", "0")
    ok = r.returncode == 1 and rep is not None and rep["requests"] > 0 and rep["ok"] == 0 and \
        rep["errors"] == rep["requests"] and rep["errors_by_status"] == {"NOT_FOUND": rep["requests"]}
    check(ok, f"a wrong model: every request counted NOT_FOUND, exit 1 ({r.returncode}: {rep})")
    check("NOT_FOUND" in r.stderr, f"a wrong model: said on stderr ({r.stderr.strip()})")
    for args, flag in [(["--concurrency", "0"], "--concurrency"), (["--rate", "fast"], "--rate"),
                       (["--duration", "-1"], "--duration"), (["--requests", "1.5"], "--requests"),
                       (["--concurrency", "2", "--channels", "3"], "--channels"), (["--poisson"], "--poisson"),
                       (["--warmup", "x"], "--warmup")]:
        r, _ = bench(port, "-m", "quant.per_tensor", "--input", "x=random:1x64:FP32", *args)
        check(r.returncode == 2 and flag in r.stderr, f"bad {' '.join(args)}: exit 2 naming {flag} ({r.stderr.strip()})")
    for spec in ["x=random:4q:FP32", "x=random:4x8:FP99", "x=random:4x8"]:
        r, _ = bench(port, "-m", "quant.per_tensor", "--input", spec)
        check(r.returncode == 2 and spec.split("=")[1] in r.stderr, f"bad --input {spec}: exit 2 naming it ({r.stderr.strip()})")
    r, _ = bench(port, "--input", "x=random:1x64:FP32")
    check(r.returncode == 2 and "-m MODEL" in r.stderr, "bench without -m: exit 2")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        repo = os.path.join(tmp, "repo")
        os.makedirs(repo)
        subprocess.run([MKSET, "--out", f"{repo}/set", "--scheme", "bf16", "--experts", "8", "--hidden", "128",
                        "--intermediate", "64", "--top-k", "2"], check=True, capture_output=True)
        p, port, _ = ts.start(tmp, "--model-repository", repo)
        try:
            test_quant(port, tmp)
            test_fused_moe(port)
            test_stream(port)
            test_errors(port)
            ts.stop(p)
        finally:
            if p.poll() is None:
                p.kill()
        ts.print_log_tail(tmp)
    ts.exit_with_summary()


if __name__ == "__main__":
    main()
