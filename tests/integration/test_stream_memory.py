"""Integration test: a stream client that does not read costs bounded memory (issue 13).

A ModelStreamInfer client sends 400 requests whose responses are 4x their
size (dequant.per_tensor, uint8 -> fp32, 1 MiB each) and reads nothing for
a while: moed stops reading its stream once --stream-buffer-bytes of
responses wait (the client's sends then block on flow control), so its
RSS grows by far less than the 400 MiB of responses; once the client
reads, every response arrives, nothing lost. With a stream budget below
one response and a total budget of a few, the work the stream had read
before its pause takes the total past the budget and the stream is ended
with RESOURCE_EXHAUSTED; the server goes on serving.

env: MOED, MOEC, MOE_LIB."""
import os
import sys
import time

import grpc
import numpy as np
from tritonclient.grpc import service_pb2 as pb

sys.path.insert(0, os.path.dirname(__file__))
from moed_process import check, moed, run_tests  # noqa: E402
import test_server as ts  # noqa: E402
from test_server import make_req  # noqa: E402

N, ROWS, COLS = 400, 256, 1024  # responses of 1 MiB: more than a client transport absorbs
METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"


def rss_mib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def requests(sent, rows=ROWS):
    rng = np.random.default_rng(3)
    q = rng.integers(0, 127, (rows, COLS), dtype=np.uint8)
    sc = np.array([0.25], np.float32)
    for k in range(N):
        r = make_req("dequant.per_tensor", [("q", "UINT8", [rows, COLS], q.tobytes()),
                                            ("scale", "FP32", [1], sc.tobytes())],
                     {"in_dtype": "fp8_e4m3fn", "out_dtype": "fp32"})
        r.id = str(k)
        sent[0] += 1
        yield r


def open_stream(port):
    ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 1 << 30)])
    fn = ch.stream_stream(METHOD, request_serializer=lambda m: m.SerializeToString(),
                          response_deserializer=pb.ModelStreamInferResponse.FromString)
    return ch, fn


def metric(port, name):
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return None


def test_paused(tmp):
    with moed(tmp, "--stream-buffer-bytes", str(16 << 20)) as (p, g, h):
        ch, fn = open_stream(g)
        before = rss_mib(p.pid)
        sent = [0]
        call = fn(requests(sent))
        time.sleep(4)  # not reading
        grown, taken = rss_mib(p.pid) - before, sent[0]
        print(f"     not reading for 4 s: {taken} of {N} requests taken, RSS +{grown:.0f} MiB")
        check(taken < N, "moed stopped reading the stream (the client's sends wait)")
        queued = metric(h, "moed_stream_buffered_bytes")
        check(queued is not None and (1 << 20) <= queued <= (16 + 34) << 20,  # the budget + 32 in work + 1
              f"moed_stream_buffered_bytes shows the unread answers, bounded ({queued})")
        if os.environ.get("MOE_SANITIZED") == "1":  # ASan's quarantine keeps freed memory: RSS says nothing
            print(f"skipped: RSS check under ASan (+{grown:.0f} MiB)")
        else:
            check(grown < 100, f"RSS grew by {grown:.0f} MiB, far less than the {N} MiB of responses")
        got = []
        for resp in call:
            got.append(resp)
        ids = [r.infer_response.id for r in got]
        errors = [r.error_message for r in got if r.error_message]
        sizes = {len(r.infer_response.raw_output_contents[0]) for r in got if not r.error_message}
        check(sorted(ids, key=int) == [str(k) for k in range(N)] and not errors and sizes == {ROWS * COLS * 4},
              f"then every response arrives ({len(got)}, {len(errors)} errors, sizes {sizes})")
        check(metric(h, "moed_stream_buffered_bytes") == 0, "... and nothing stays counted as buffered")
        ch.close()


def test_ended(tmp):
    # 4 MiB answers, merged four to a batch (row-independent op, 4096 rows per batch, a long queue
    # delay): the batch's answers are queued one after the other while the first is being written,
    # so the second finds the stream over its budget and the total past it
    with moed(tmp, "--stream-buffer-bytes", str(64 << 10), "--response-buffer-bytes", str(2 << 20),
              "--max-batch-tokens", "4096", "--max-queue-delay-us", "500000") as (_, g, _):
        ch, fn = open_stream(g)
        sent = [0]
        call = fn(requests(sent, rows=1024))
        time.sleep(3)
        code = None
        try:
            for _ in call:
                pass
        except grpc.RpcError as e:
            code = e.code()
        check(code == grpc.StatusCode.RESOURCE_EXHAUSTED, f"a stream past the total budget ends ({code})")
        ch.close()
        req = next(requests([0], rows=8))
        resp = ts.infer_pb(grpc.insecure_channel(f"127.0.0.1:{g}"), req)
        check(len(resp.raw_output_contents[0]) == 8 * COLS * 4, "the server goes on serving")


if __name__ == "__main__":
    run_tests(test_paused, test_ended)
