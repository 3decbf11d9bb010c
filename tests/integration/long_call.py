"""What the integration tests that keep moed's one worker busy share (not a
test itself: ctest runs test_*.py; test_stop.py and test_rest_gone.py import
it): the expert set `bigset`, whose fused_moe call takes seconds on the CPU
backend, a call sized from a first timed one (for bounds that scale with
the machine), the blocker that occupies the worker until the test ends it,
and waits on /metrics (for a state, not a time)."""
import os
import time
import urllib.request

import grpc
import numpy as np

from moed_process import check
from test_fused_moe import mkset
from test_server import code_of, make_req

SC = grpc.StatusCode
HIDDEN, EXPERTS = 512, 8


def call_fn(ch):
    return ch.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                          request_serializer=lambda m: m.SerializeToString())


def req_of(tokens, seed=1, params=None):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, HIDDEN)).astype(np.float32)
    xb = (x.view(np.uint32) >> 16).astype(np.uint16)
    logits = rng.standard_normal((tokens, EXPERTS)).astype(np.float32)
    return make_req("bigset", [("hidden_states", "BF16", [tokens, HIDDEN], xb.tobytes()),
                               ("router_logits", "FP32", [tokens, EXPERTS], logits.tobytes())], params)


def timed(fn):
    t = time.monotonic()
    code, msg = code_of(fn)
    return code, msg, time.monotonic() - t


def channel(port):
    return grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 1 << 30),
                                                               ("grpc.max_receive_message_length", 1 << 30)])


def calibrate(f, seconds=6.0):
    """Tokens for a call of about `seconds` (at least half of it, measured),
    and its time. Linear in tokens, but fixed costs (first touch of the
    weights, a loaded machine) make a small call's rate an underestimate:
    the call grows until it takes two thirds of `seconds`."""
    # 16 tokens first: 256 took 20-50 s under a loaded sanitizer build
    code, msg, t = timed(lambda: f(req_of(16), timeout=300))
    check(code == SC.OK, f"calibration call OK ({code} {msg})")
    tokens = min(65536, max(16, int(16 * seconds / max(t, 1e-3))))
    for _ in range(3):
        code, msg, full = timed(lambda: f(req_of(tokens), timeout=300))
        if code != SC.OK or full >= seconds * 2 / 3 or tokens >= 65536:
            break
        tokens = min(65536, int(tokens * seconds / max(full, 0.01)))
    check(code == SC.OK and full >= seconds / 2, f"long call: {tokens} tokens in {full:.2f}s ({code} {msg})")
    return tokens, full


def metric_values(http_port, prefix):
    """The values of every /metrics sample whose line starts with `prefix`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as r:
        return [float(ln.rsplit(" ", 1)[1]) for ln in r.read().decode().splitlines() if ln.startswith(prefix)]


def wait_metric(http_port, prefix, want, what, seconds=20):
    """Waits (a state, not a time: the bound only ends a failing wait) until
    the sum of the samples under `prefix` is `want`."""
    got = None
    for _ in range(int(seconds / 0.02)):
        got = sum(metric_values(http_port, prefix))
        if got == want:
            break
        time.sleep(0.02)
    check(got == want, f"{what} ({prefix}: {got}, want {want})")


def bigset_repo(tmp):
    """A model repository in tmp holding `bigset`; its path."""
    repo = os.path.join(tmp, "repo")
    mkset(f"{repo}/bigset", "bf16", experts=EXPERTS, hidden=HIDDEN, inter=4096)
    return repo


BLOCKER_TOKENS = 65536
_blocker_req = []


def blocker_req():
    """The blocker's request (built once: 66 MiB)."""
    if not _blocker_req:
        _blocker_req.append(req_of(BLOCKER_TOKENS, seed=99))
    return _blocker_req[0]


def blocker(f, http_port, timeout=3600):
    """A call that keeps moed's one worker busy until the test ends it
    (cancels it, its deadline, or a drain stops it); its future, once it
    runs. 65536 tokens: tens of seconds on a fast machine, minutes under a
    sanitizer, and never sized from a timed call (a load that lifts between
    the timing and the call made such a blocker end before the test
    looked). The op stops at its next work item once nobody waits for it
    (infer_run.c)."""
    return busy_worker(http_port, f.future(blocker_req(), timeout=timeout), "the blocker runs on the one worker")


def busy_worker(http_port, call, what="the long call runs on the one worker"):
    """Waits until `call`, a long call just sent (its future, or its REST
    connection), runs on moed's one worker; returns it."""
    wait_metric(http_port, "moed_batches_in_flight ", 1, what)
    return call
