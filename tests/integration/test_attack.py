"""Integration test: what an outside attacker found (tests that failed
before their fix; each names the defect).

- A ModelInfer message may give model_name twice; protobuf-c decodes the
  last one. The inline fast path (small unbatched calls of ops without
  weights run on the gRPC thread) chose by the first one: a message naming
  a cheap op first and an expert set last ran the expert set's fused_moe on
  the one gRPC thread, and every other call, probes included, waited for it.

env: MOED, MOEC, MOE_LIB, MOE_MKSET."""
import os
import sys
import threading
import time

import grpc
import numpy as np
from tritonclient.grpc import service_pb2 as pb

sys.path.insert(0, os.path.dirname(__file__))
from moed_process import check, moed, run_tests  # noqa: E402
from test_fused_moe import mkset  # noqa: E402
from test_server import make_req, raw_unary  # noqa: E402

SC = grpc.StatusCode


def test_model_name_twice(tmp):
    # an expert set whose call of a message under --inline-bytes (64 KiB)
    # takes a while on the CPU backend: 12 tokens of H=1024 through 8 of 8
    # experts of I=2048
    repo = os.path.join(tmp, "repo-twice")
    mkset(f"{repo}/heavy", "bf16", experts=8, hidden=1024, inter=2048, top_k=8)
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((12, 1024)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    logits = rng.standard_normal((12, 8)).astype(np.float32)
    plain = make_req("heavy", [("hidden_states", "BF16", [12, 1024], x.tobytes()),
                               ("router_logits", "FP32", [12, 8], logits.tobytes())]).SerializeToString()
    # the same message led by a model_name naming a cheap op that is not batched
    twice = pb.ModelInferRequest(model_name="quant.per_tensor").SerializeToString() + plain
    check(len(twice) < 65536, f"the message fits --inline-bytes ({len(twice)} bytes)")
    with moed(tmp, "--model-repository", repo, "--workers", "1") as (_, port, _h):
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        infer = raw_unary(ch, "/inference.GRPCInferenceService/ModelInfer")
        want = infer(plain, timeout=120)
        t = time.monotonic()
        got = infer(twice, timeout=120)
        call_s = time.monotonic() - t
        check(got == want, f"model_name given twice: the last one ('heavy') answers ({call_s:.2f} s a call)")
        stop = threading.Event()

        def attacker():
            while not stop.is_set():
                infer(twice, timeout=120)

        threads = [threading.Thread(target=attacker) for _ in range(2)]
        for th in threads:
            th.start()
        probe_ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        live = raw_unary(probe_ch, "/inference.GRPCInferenceService/ServerLive")
        live(b"", timeout=60)
        waits = []
        for _ in range(8):
            t = time.monotonic()
            live(b"", timeout=60)
            waits.append(time.monotonic() - t)
            time.sleep(call_s / 8)
        stop.set()
        for th in threads:
            th.join()
        med = sorted(waits)[len(waits) // 2]
        check(med < call_s / 4,
              f"ServerLive answers while such calls run (median {med * 1e3:.1f} ms, a call {call_s * 1e3:.0f} ms)")
        probe_ch.close()
        ch.close()


if __name__ == "__main__":
    run_tests(test_model_name_twice)
