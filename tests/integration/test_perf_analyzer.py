"""Integration test: Triton's perf_analyzer, unchanged, against a real moed
over gRPC: concurrency 1..8 on quant.per_tensor (random data, the token
shape given) with --collect-metrics reading moed's /metrics, 1..4 on a
moe-mkset expert set (--input-data JSON with valid bf16 activations and
router logits, two rows per request) and on moe.topk with its top_k as a
--request-parameter; each run exits 0 and prints the server-side breakdown
for every concurrency level, whose request counts moed's own
ModelStatistics must cover. Over HTTP (`-i http`) against the KServe REST
port: quant.per_tensor 1..4 and the expert set 1..8; and quant.per_token
with `--shared-memory system` (perf_analyzer's own regions) over both.

perf_analyzer comes from scripts/requirements-perf.txt (installed by
scripts/deps.sh into .venv/perf_analyzer; that file says why this release).

env: MOED, MOEC, MOE_LIB, MOE_MKSET."""
import base64
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import tritonclient.grpc as tc

sys.path.insert(0, os.path.dirname(__file__))
from moed_process import check, exit_with_summary, moed, print_log_tail  # noqa: E402
from test_server import bf16  # noqa: E402

MKSET = os.environ["MOE_MKSET"]
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PA_DIR = os.path.join(ROOT, ".venv", "perf_analyzer")
PA = os.path.join(PA_DIR, "bin", "perf_analyzer")
HIDDEN, EXPERTS = 128, 8
LEVELS = 4


def perf_analyzer(port, model, *args, protocol="grpc", levels=LEVELS):
    env = dict(os.environ, LD_LIBRARY_PATH=os.path.join(PA_DIR, "nvidia", "cuda_runtime", "lib"))
    # what is tested is that perf_analyzer works against moed, not how steady a shared CI machine is:
    # its stability check off (as Triton's own CI does), which at 50% failed a loaded run ("Failed
    # to obtain stable measurement within 20 measurement windows")
    cmd = [PA, "-i", protocol, "-u", f"127.0.0.1:{port}", "-m", model, "--concurrency-range", f"1:{levels}",
           "--measurement-interval", "300", "--max-trials", "20", "--stability-percentage", "9999", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def check_run(r, what, cli, model, levels=LEVELS):
    out = r.stdout + r.stderr
    check(r.returncode == 0, f"{what}: perf_analyzer exit 0 ({r.returncode}: {out[-600:] if r.returncode else ''})")
    seen = re.findall(r"Request concurrency: (\d+)", out)
    check(seen == [str(i) for i in range(1, levels + 1)], f"{what}: concurrency 1..{levels} measured ({seen})")
    # the server-side breakdown, from ModelStatistics, once per level
    breakdown = re.findall(r"Successful request count: (\d+)\n\s+Avg request latency: \d+ usec \(overhead \d+ usec "
                           r"\+ queue \d+ usec \+ compute input \d+ usec \+ compute infer \d+ usec \+ compute "
                           r"output \d+ usec\)", out)
    check(len(breakdown) == levels and all(int(n) > 0 for n in breakdown),
          f"{what}: server-side breakdown printed for every level ({breakdown})")
    total = cli.get_inference_statistics(model).model_stats[0].inference_stats.success.count
    check(total >= sum(int(n) for n in breakdown), f"{what}: moed counted at least the measured requests ({total})")


def input_data(path, rng, entries=8):
    """perf_analyzer's --input-data: one entry per batch row (the model has a
    batch axis, so shapes leave it out); bf16 as raw bits in b64."""
    data = []
    for _ in range(entries):
        x = bf16(rng.standard_normal(HIDDEN))
        data.append({"hidden_states": {"b64": base64.b64encode(x.tobytes()).decode(), "shape": [HIDDEN]},
                     "router_logits": {"content": rng.standard_normal(EXPERTS).astype(np.float32).tolist(),
                                       "shape": [EXPERTS]}})
    with open(path, "w") as f:
        json.dump({"data": data}, f)


def main():
    if not os.access(PA, os.X_OK):
        check(False, f"perf_analyzer at {PA} (run scripts/deps.sh)")
        exit_with_summary()
    with tempfile.TemporaryDirectory() as tmp:
        repo = os.path.join(tmp, "repo")
        subprocess.run([MKSET, "--out", f"{repo}/set", "--scheme", "bf16", "--experts", str(EXPERTS), "--hidden",
                        str(HIDDEN), "--intermediate", "64", "--top-k", "2"], check=True, capture_output=True)
        data = os.path.join(tmp, "set.json")
        input_data(data, np.random.default_rng(3))
        with moed(tmp, "--model-repository", repo) as (p, port, http_port):
            cli = tc.InferenceServerClient(f"127.0.0.1:{port}")
            # concurrency 1..8 on a quant op over gRPC, reading moed's /metrics too (--collect-metrics)
            metrics = ("--collect-metrics", "--metrics-url", f"127.0.0.1:{http_port}/metrics")
            r = perf_analyzer(port, "quant.per_tensor", "--shape", "x:4,64", *metrics, levels=8)
            check_run(r, "quant.per_tensor, 1..8", cli, "quant.per_tensor", levels=8)
            check((r.stdout + r.stderr).count("Server Prometheus Metrics:") == 8,
                  "--collect-metrics: perf_analyzer read moed's /metrics at every level")
            check_run(perf_analyzer(port, "set", "--input-data", data, "-b", "2"), "expert set", cli, "set")
            # an op's parameter as perf_analyzer sends it (gRPC only in this release): moe.topk's top_k
            check_run(perf_analyzer(port, "moe.topk", "--shape", "router_logits:4,8", "--shape", "correction_bias:8",
                                    "--request-parameter", "top_k:2:int"), "moe.topk with top_k", cli, "moe.topk")
            check_run(perf_analyzer(p.rest_port, "quant.per_tensor", "--shape", "x:4,64", protocol="http"),
                      "quant.per_tensor over HTTP", cli, "quant.per_tensor")
            check_run(perf_analyzer(p.rest_port, "set", "--input-data", data, "-b", "2", protocol="http", levels=8),
                      "expert set over HTTP, 1..8", cli, "set", levels=8)
            # Triton's system shared memory: perf_analyzer makes, registers and uses its own regions
            # (a model without optional inputs: this perf_analyzer refuses those with shared memory)
            shm_args = ("-b", "4", "--shape", "x:64", "--shared-memory", "system", "--output-shared-memory-size",
                        "65536")
            check_run(perf_analyzer(port, "quant.per_token", *shm_args), "quant.per_token, shared memory", cli,
                      "quant.per_token")
            check_run(perf_analyzer(p.rest_port, "quant.per_token", *shm_args, protocol="http"),
                      "quant.per_token, shared memory over HTTP", cli, "quant.per_token")
            check(len(cli.get_system_shared_memory_status().regions) == 0, "perf_analyzer unregistered its regions")
            s = cli.get_inference_statistics("set").model_stats[0]
            check(s.inference_count == 2 * s.inference_stats.success.count,
                  f"expert set: inference_count counts 2 rows per request ({s.inference_count})")
        print_log_tail(tmp)
    exit_with_summary()


if __name__ == "__main__":
    main()
