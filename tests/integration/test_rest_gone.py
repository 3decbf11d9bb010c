"""Integration test: a KServe REST client that leaves while its request is
queued or running (issues 11, 13; docs/server.md "Abandoned work").

One worker runs a long fused_moe call (long_call.py, as test_stop.py). REST
clients behind it leave in each way a client can: a close (FIN), a reset
(RST), and a keep-alive client's half-close. moed sees it while the request
waits (http_conn.c reads on while a request is in work), answers the request
CANCELLED without writing to the socket, and the job leaves the device queue
at once, so a live call is admitted where the queue was full; each such
request counts once as a failure and once in
moed_http_requests_abandoned_total. A client that half-closes after a last
request that says `Connection: close` (alone, or at the end of a pipeline)
has said it sends nothing more: it is answered, not cancelled. The request
running on the worker stops when its REST client leaves (the worker is free
at once). In a merged batch queued behind the long call, the rows of clients
that left are dropped before it runs: ModelStatistics shows an execution of
the live rows only, and each live answer is byte-equal to the same request
run alone. The same over TLS.

env: MOED, MOEC, MOE_LIB, MOE_MKSET."""
import http.client
import json
import os
import socket
import ssl
import struct
import sys
import tempfile
import time
import urllib.request

import grpc
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from moed_process import check, exit_with_summary, moed, print_log_tail  # noqa: E402
import test_server as ts  # noqa: E402
from long_call import (BLOCKER_TOKENS, EXPERTS, HIDDEN, bigset_repo, blocker, busy_worker, calibrate,  # noqa: E402
                       call_fn, channel, metric_values, req_of, timed, wait_metric)

SC = grpc.StatusCode
QUEUE = "moed_device_queue_jobs{"
FAILED = 'moed_requests_total{model="bigset",outcome="failure"}'
ABANDONED = 'moed_http_requests_abandoned_total{port="rest"}'
REST_OPEN = 'moed_http_connections{port="rest"}'


def inputs_of(tokens, seed):
    """The bytes req_of(tokens, seed) sends: bf16 hidden states, fp32 logits."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, HIDDEN)).astype(np.float32)
    logits = rng.standard_normal((tokens, EXPERTS)).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16).tobytes(), logits.tobytes()


def rest_request(port, tokens, seed, close=False):
    """A REST infer request for req_of(tokens, seed)'s inputs, in Triton's
    binary extension, as raw bytes (keep-alive unless `close`)."""
    xb, lg = inputs_of(tokens, seed)
    head = json.dumps({"inputs": [
        {"name": "hidden_states", "datatype": "BF16", "shape": [tokens, HIDDEN],
         "parameters": {"binary_data_size": len(xb)}},
        {"name": "router_logits", "datatype": "FP32", "shape": [tokens, EXPERTS],
         "parameters": {"binary_data_size": len(lg)}}],
        "outputs": [{"name": "output", "parameters": {"binary_data": True}}]}).encode()
    body = head + xb + lg
    lines = [f"POST /v2/models/bigset/infer HTTP/1.1", f"Host: 127.0.0.1:{port}",
             "Content-Type: application/octet-stream", f"Inference-Header-Content-Length: {len(head)}",
             f"Content-Length: {len(body)}"] + (["Connection: close"] if close else [])
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class _Unclosed:
    """The connection's one reader, which an answer's end does not close."""

    def __init__(self, f):
        self.f = f

    def __getattr__(self, name):
        return getattr(self.f, name)

    def close(self):
        pass


class Client:
    """A raw REST connection that has sent reqs (pipelined when several) and
    reads the answers in order."""

    def __init__(self, port, *reqs, tls=None):
        self.s = socket.create_connection(("127.0.0.1", port), timeout=120)
        self.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls:  # an ssl.SSLContext
            self.s = tls.wrap_socket(self.s, server_hostname="127.0.0.1")
        self.f = self.s.makefile("rb")
        self.s.sendall(b"".join(reqs))

    def makefile(self, *args, **kw):  # http.client reads through this
        return _Unclosed(self.f)

    def response(self):
        """The next answer: status, and the output's bytes (binary) or the error text."""
        r = http.client.HTTPResponse(self)
        r.begin()
        body = r.read()
        n = int(r.getheader("Inference-Header-Content-Length", "-1"))
        return r.status, (body[n:] if r.status == 200 and n >= 0 else body.decode(errors="replace"))

    def ended(self):
        """Whether moed closed the connection with nothing (more) written."""
        return self.f.read(1) == b""

    def half_close(self):
        # the TCP socket's own: SSLSocket.shutdown would drop the TLS session, and
        # the answer would then be read as raw records
        socket.socket.shutdown(self.s, socket.SHUT_WR)

    def close(self):
        self.f.close()
        self.s.close()

    def reset(self):
        """Closes with an RST (SO_LINGER 0) instead of a FIN."""
        self.s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close()


def alone(port, tokens, seed):
    """The output bytes of req_of(tokens, seed) run alone (gRPC)."""
    resp = ts.infer_pb(channel(port), req_of(tokens, seed), timeout=120)
    return resp.raw_output_contents[0]


def rest_stats(rest_port):
    with urllib.request.urlopen(f"http://127.0.0.1:{rest_port}/v2/models/bigset/stats", timeout=30) as r:
        return json.loads(r.read())["model_stats"][0]


def test_queued_and_running(tmp, repo):
    """Queued REST requests whose clients leave free the queue; the running one stops."""
    n = 3
    with moed(tmp, "--model-repository", repo, "--workers", "1", "--max-queue-size", str(n),
              "--max-batch-tokens", "0") as (p, port, http_port):  # no batching: one job per request
        rest = p.rest_port
        f = call_fn(channel(port))
        full = calibrate(f)[1]
        busy = blocker(f, http_port)
        fail0 = sum(metric_values(http_port, FAILED))

        # three clients that leave: a close, a reset, a keep-alive half-close
        leavers = [Client(rest, rest_request(rest, 1, seed=10 + k)) for k in range(n)]
        wait_metric(http_port, QUEUE, n, f"{n} REST requests queued behind the long call")
        s = Client(rest, rest_request(rest, 1, seed=19))
        status, msg = s.response()
        s.close()
        check(status == 503 and "device queue full" in msg, f"a live call beyond {n} jobs: 503 ({status} {msg})")
        leavers[0].close()
        leavers[1].reset()
        leavers[2].half_close()
        # "at once": well before the long call could end and let the worker drain the queue
        wait_metric(http_port, QUEUE, 0, "requests whose REST clients left leave the device queue at once",
                    seconds=full / 2)
        wait_metric(http_port, ABANDONED, n, "each counted as abandoned on the REST port")
        check(leavers[2].ended(), "the half-closed keep-alive client gets no answer: the connection ends")
        leavers[2].close()
        check(not busy.done(), "the long call still runs: the queue was emptied by the sweep, not the worker")

        # live callers fill the queue the leavers left: a keep-alive one, one that half-closes after a last
        # request (Connection: close), and a pipeline of two whose last says close, then half-closed
        keep = Client(rest, rest_request(rest, 2, seed=20))
        last = Client(rest, rest_request(rest, 3, seed=21, close=True))
        pipe = Client(rest, rest_request(rest, 1, seed=22), rest_request(rest, 2, seed=23, close=True))
        wait_metric(http_port, QUEUE, n, "live REST calls admitted where the leavers' jobs were")
        last.half_close()
        pipe.half_close()
        # a leaver after them: once it is counted, the loop has read the half-closes above too
        bye = Client(rest, rest_request(rest, 1, seed=24))
        status, msg = bye.response()  # the queue is full of live jobs: refused, not queued
        bye.close()
        check(status == 503, f"a fourth call while three live ones are queued: 503 ({status})")
        check(sum(metric_values(http_port, QUEUE)) == n and sum(metric_values(http_port, ABANDONED)) == n,
              "the half-closed clients that said Connection: close are not taken as gone")
        check(busy.cancel(), "the long call cancelled (stopped at its next work item: the worker runs the live calls)")
        for name, s, seeds in (("keep-alive", keep, [(2, 20)]), ("half-closed", last, [(3, 21)]),
                               ("pipelined, half-closed", pipe, [(1, 22), (2, 23)])):
            for rows, seed in seeds:
                status, out = s.response()
                check(status == 200 and out == alone(port, rows, seed),
                      f"{name} client answered ({rows} rows): 200, the bytes of the call alone ({status})")
            if s is not keep:
                check(s.ended(), f"{name} client: the connection closed after its last answer")
            s.close()

        # the running call: its REST client leaves, the worker is free at once
        run = busy_worker(http_port, Client(rest, rest_request(rest, BLOCKER_TOKENS, seed=30)), "a long REST call runs")
        t0 = time.monotonic()
        run.close()
        wait_metric(http_port, "moed_batches_in_flight ", 0, "the running call stops when its client leaves",
                    seconds=full / 2)
        code, msg, t = timed(lambda: f(req_of(1, seed=31), timeout=60))
        check(code == SC.OK and time.monotonic() - t0 < full / 2,
              f"the worker is free: the next call answered {time.monotonic() - t0:.2f}s after the close "
              f"(the call alone takes {full:.1f}s)")

        wait_metric(http_port, "moed_inflight_requests ", 0, "nothing left in flight")
        wait_metric(http_port, QUEUE, 0, "nothing left queued")
        wait_metric(http_port, ABANDONED, n + 1, "the running call counted as abandoned too")
        wait_metric(http_port, REST_OPEN, 0, "no REST connection left open")
        # each answered once: 3 leavers, 2 refused, the long call, the running REST call
        wait_metric(http_port, FAILED, fail0 + n + 2 + 1 + 1, "failures counted once each")
        st = rest_stats(rest)
        check(int(st["inference_stats"]["fail"]["count"]) == fail0 + n + 2 + 1 + 1,
              f"ModelStatistics counts the same failures ({st['inference_stats']['fail']})")
    return full


def test_merged_batch(tmp, repo):
    """Issue 11: a merged batch queued behind the long call loses the rows of
    REST clients that left before it runs; the live rows' bytes are those of
    each request alone."""
    with moed(tmp, "--model-repository", repo, "--workers", "1", "--max-batch-tokens", "64",
              "--max-queue-delay-us", "300000") as (p, port, http_port):
        rest = p.rest_port
        f = call_fn(channel(port))
        busy = blocker(f, http_port)
        # four requests in one open batch (300 ms), then one job queued behind the long call
        rows = {40: 2, 41: 1, 42: 3, 43: 4}  # seed: rows; 41 and 43 leave (5 rows), 40 and 42 stay (5 rows)
        conns = {seed: Client(rest, rest_request(rest, r, seed)) for seed, r in rows.items()}
        wait_metric(http_port, QUEUE, 1, "the merged batch queued as one job")
        wait_metric(http_port, "moed_batcher_requests ", 0, "... none left in the open batch")
        conns.pop(41).close()
        conns.pop(43).reset()
        wait_metric(http_port, ABANDONED, 2, "two of the batch's clients left")
        check(sum(metric_values(http_port, QUEUE)) == 1, "the job stays queued for its live requests")
        busy.cancel()
        for seed, s in conns.items():
            status, out = s.response()
            check(status == 200 and out == alone(port, rows[seed], seed),
                  f"live request {seed} ({rows[seed]} rows) answered: 200, the bytes of the call alone ({status})")
            s.close()
        sizes = {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in rest_stats(rest)["batch_stats"]}
        check(sizes.get(5) == 1 and 10 not in sizes,
              f"the batch ran with the live rows only (5 of 10): batch_stats sizes {sizes}")
        wait_metric(http_port, "moed_inflight_requests ", 0, "nothing left in flight")
        wait_metric(http_port, QUEUE, 0, "nothing left queued")


def test_tls(tmp, repo, full):
    """The same over TLS (the REST port with --tls-cert: http_conn.c decrypts
    what arrives while a request is in work): a close and a reset leave the
    queue, a half-close after a Connection: close request is answered, and
    the long call, sent over REST too, stops when its client closes."""
    from test_security import make_certs
    d = os.path.join(tmp, "certs")
    os.makedirs(d, exist_ok=True)
    pem = make_certs(d)
    with moed(tmp, "--model-repository", repo, "--workers", "1", "--max-batch-tokens", "0",
              "--tls-cert", pem("server-ca1.pem"), "--tls-key", pem("server-ca1.key"),
              "--http-port-plaintext") as (p, port, http_port):
        rest = p.rest_port
        tls = ssl.create_default_context(cafile=pem("ca1.pem"))
        blocker = busy_worker(http_port, Client(rest, rest_request(rest, BLOCKER_TOKENS, seed=1), tls=tls),
                              "TLS: the long REST call runs on the one worker")
        gone = [Client(rest, rest_request(rest, 1, seed=2 + k), tls=tls) for k in range(2)]
        last = Client(rest, rest_request(rest, 2, seed=4, close=True), tls=tls)
        wait_metric(http_port, QUEUE, 3, "TLS: three requests queued")
        gone[0].close()
        gone[1].reset()
        last.half_close()
        wait_metric(http_port, QUEUE, 1, "TLS: the two that left leave the queue at once", seconds=full / 2)
        wait_metric(http_port, ABANDONED, 2, "TLS: counted as abandoned")
        blocker.close()
        wait_metric(http_port, "moed_batches_in_flight ", 0, "TLS: the long call stops when its client closes",
                    seconds=full / 2)
        status, out = last.response()
        check(status == 200 and out == alone_tls(port, pem, 2, 4),
              f"TLS: the half-closed Connection: close client answered: 200, the bytes alone ({status})")
        check(last.ended(), "TLS: then the connection closed")
        last.close()
        wait_metric(http_port, ABANDONED, 3, "TLS: the long call counted as abandoned")
        wait_metric(http_port, "moed_inflight_requests ", 0, "TLS: nothing left in flight")
        wait_metric(http_port, REST_OPEN, 0, "TLS: no REST connection left open")


def alone_tls(port, pem, tokens, seed):
    """alone() over the TLS gRPC port."""
    creds = grpc.ssl_channel_credentials(root_certificates=open(pem("ca1.pem"), "rb").read())
    ch = grpc.secure_channel(f"127.0.0.1:{port}", creds)
    return ts.infer_pb(ch, req_of(tokens, seed), timeout=120).raw_output_contents[0]


def main():
    with tempfile.TemporaryDirectory() as tmp:
        repo = bigset_repo(tmp)
        full = test_queued_and_running(tmp, repo)
        test_merged_batch(tmp, repo)
        test_tls(tmp, repo, full)
        print_log_tail(tmp)
    exit_with_summary()


if __name__ == "__main__":
    main()
