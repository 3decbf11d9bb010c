"""Integration test: limits that keep one kind of client from locking out
the rest (issue 13).

- The metrics/probe port (--http-port) flooded with idle connections past
  --http-max-connections: the cap's slots stay held by the flood, yet
  /metrics and the probes answer (a connection past the cap has 250 ms for
  its request, and a new one replaces the oldest of those that sent
  nothing), descriptors stay bounded, gRPC health answers, and the flood's
  extra connections are closed and counted as refused.
- gRPC request messages held until answered are bounded together by
  --grpc-body-budget-bytes: a message past what is left is RESOURCE_EXHAUSTED
  naming the flag, the bytes are given back when each request is answered
  (moed_grpc_request_bytes), and the probes pass.
- Messages still arriving are bounded by gRPC core's resource quota
  (--grpc-memory-bytes): HTTP/2 streams that each announce a 512 MiB
  message and send 16 MiB of it, never the rest (40 of them buffered
  640 MiB before the quota; 2.6 GiB at 64 MiB each), are reset once moed's
  memory nears the quota, its RSS stays within it, and health and a call
  are still answered.

env: MOED, MOEC, MOE_LIB."""
import os
import socket
import sys
import threading
import time

import grpc
import h2.config
import h2.connection
import h2.events
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from moed_process import moed, run_tests  # noqa: E402
from test_connections import fd_count, http_get  # noqa: E402
from test_server import check, code_of, infer_pb, make_req, raw_unary  # noqa: E402

SC = grpc.StatusCode
CAP = 32  # as many again may wait on probation: a flood must outrun a probe's first round trip
SERVING = b"\x08\x01"  # grpc.health.v1.HealthCheckResponse{status: SERVING}


def metric(text, name):
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def is_closed(sock, wait):
    """Whether the peer closed sock within `wait` seconds."""
    sock.settimeout(wait)
    try:
        return sock.recv(1) == b""
    except socket.timeout:
        return False
    except OSError:
        return True


def health(port):
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        return raw_unary(ch, "/grpc.health.v1.Health/Check")(b"", timeout=5)
    except grpc.RpcError as e:
        return e.code()
    finally:
        ch.close()


def test_metrics_port_flood(tmp):
    # a long handshake timeout: the flood's connections hold the cap's slots for the whole test
    flood = []
    with moed(tmp, "--http-max-connections", str(CAP), "--handshake-timeout", "60") as (p, g, h):
        try:
            check(http_get(h, "/v2/health/live")[0] == 200, "live before the flood")
            base = fd_count(p.pid)
            held = [socket.create_connection(("127.0.0.1", h)) for _ in range(CAP)]
            time.sleep(0.3)
            extra = [socket.create_connection(("127.0.0.1", h)) for _ in range(3 * CAP)]
            closed = sum(is_closed(s, 1.0) for s in extra)
            check(closed == len(extra), f"idle connections past the cap closed ({closed} of {len(extra)})")
            still = sum(not is_closed(s, 0.01) for s in held)
            check(still == CAP, f"the cap's {CAP} idle connections are still open ({still})")
            for s in extra:
                s.close()

            # the cap is full of idle connections: the probes and a scrape still answer
            live, _ = http_get(h, "/v2/health/live")
            ready, _ = http_get(h, "/v2/health/ready")
            code, text = http_get(h, "/metrics")
            check(live == 200 and ready == 200, f"probes answer with the cap held ({live}, {ready})")
            check(code == 200 and metric(text, 'moed_http_connections{port="http"}') is not None,
                  f"/metrics answers with the cap held ({code})")
            check(health(g) == SERVING, "gRPC health answers SERVING")

            # ... and while a flood keeps opening connections that send nothing
            stop = threading.Event()

            def storm():  # ~500 a second, 15 times the cap's worth: the probe's GIL-bound client keeps up
                while not stop.is_set() and len(flood) < 600:
                    try:
                        flood.append(socket.create_connection(("127.0.0.1", h), timeout=2))
                    except OSError:
                        pass
                    time.sleep(0.002)

            t = threading.Thread(target=storm)
            t.start()
            try:
                time.sleep(0.3)
                answers = [http_get(h, "/v2/health/live")[0] for _ in range(5)]
                code, text = http_get(h, "/metrics")
                fds = fd_count(p.pid)
                grpc_health = health(g)
            finally:
                stop.set()
                t.join()
            print(f"     {len(flood)} flood connections; descriptors {base} before, {fds} during")
            check(answers == [200] * 5, f"live answers during the flood ({answers})")
            check(code == 200 and metric(text, "moed_grpc_request_bytes") is not None,
                  f"/metrics answers during the flood ({code})")
            check(grpc_health == SERVING, f"gRPC health answers during the flood ({grpc_health})")
            # the cap's slots, as many on probation, the probes' own connections and a few in closing
            check(fds <= base + 2 * CAP + 8, f"descriptors bounded during the flood ({fds}, base {base})")
            for s in flood:
                s.close()
            time.sleep(0.5)
            code, text = http_get(h, "/metrics")
            refused = metric(text, 'moed_http_connections_closed_total{port="http",reason="refused"}')
            check(refused is not None and refused >= len(extra),
                  f"connections past the cap counted as refused ({refused})")
            for s in held:
                s.close()
        finally:
            for s in flood:
                s.close()


def request(rows, seed=1):
    """quant.mx (merged along its rows by the batcher) over rows x 64 fp32: 256 bytes a row."""
    x = np.random.default_rng(seed).standard_normal((rows, 64)).astype(np.float32)
    return make_req("quant.mx", [("x", "FP32", [rows, 64], x.tobytes())], {"format": "mxfp4"})


def test_grpc_body_budget(tmp):
    budget = 1 << 20
    # a batchable request waits up to the queue delay in the batcher: held, in work, for 1.5 s
    with moed(tmp, "--grpc-body-budget-bytes", str(budget), "--max-batch-tokens", "100000",
              "--max-queue-delay-us", "1500000") as (p, g, h):
        ch = grpc.insecure_channel(f"127.0.0.1:{g}", options=[("grpc.max_send_message_length", 64 << 20)])
        try:
            big = request(3000)  # ~768 KiB: under the budget alone
            size = big.ByteSize()
            check(size < budget < 2 * size, f"one request fits the budget, two do not ({size} of {budget})")
            codes = [code_of(lambda: infer_pb(ch, big, timeout=30))[0] for _ in range(4)]
            check(codes == [SC.OK] * 4, f"requests one after the other each fit: bytes given back ({codes})")

            over = request(5000)  # ~1.25 MiB: past the budget alone
            code, msg = code_of(lambda: infer_pb(ch, over, timeout=30))
            check(code == SC.RESOURCE_EXHAUSTED and f"--grpc-body-budget-bytes {budget}" in msg,
                  f"a message past the budget: RESOURCE_EXHAUSTED naming it ({code} {msg})")

            # one request held in the batcher: a second that does not fit beside it is refused, a
            # small one and the probes pass, and the first is answered
            first = {}
            t = threading.Thread(target=lambda: first.update(r=code_of(lambda: infer_pb(ch, big, timeout=30))))
            t0 = time.monotonic()
            t.start()
            time.sleep(0.5)
            held = metric(http_get(h, "/metrics")[1], "moed_grpc_request_bytes")
            check(held is not None and held >= size, f"moed_grpc_request_bytes counts the held request ({held})")
            code, msg = code_of(lambda: infer_pb(ch, big, timeout=30))
            check(code == SC.RESOURCE_EXHAUSTED and "--grpc-body-budget-bytes" in msg and time.monotonic() - t0 < 1.4,
                  f"a second one past what is left: RESOURCE_EXHAUSTED at once ({code} {msg})")
            check(code_of(lambda: infer_pb(ch, request(16), timeout=30))[0] == SC.OK, "a small one fits beside it")
            check(health(g) == SERVING, "gRPC health passes")
            t.join()
            check(first.get("r", (None,))[0] == SC.OK, f"the held request is answered ({first.get('r')})")
            time.sleep(0.2)
            held = metric(http_get(h, "/metrics")[1], "moed_grpc_request_bytes")
            check(held == 0, f"every byte given back once all are answered ({held})")

            # a stream message past the budget ends its stream with the same status
            stream = ch.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                      request_serializer=lambda m: m.SerializeToString(),
                                      response_deserializer=lambda b: b)
            code, msg = code_of(lambda: list(stream(iter([over]), timeout=30)))
            check(code == SC.RESOURCE_EXHAUSTED and "--grpc-body-budget-bytes" in msg,
                  f"a stream message past the budget ends the stream ({code} {msg})")
            check(code_of(lambda: infer_pb(ch, big, timeout=30))[0] == SC.OK, "then a request that fits is served")
        finally:
            ch.close()


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) // 1024 for ln in f if ln.startswith("VmRSS"))


def partial_streams(port, pid, conns, streams, each, seconds):
    """`conns` HTTP/2 connections, each with `streams` ModelInfer streams
    that announce a 512 MiB message and send `each` bytes of it, as fast as
    flow control lets them, never the rest (raw h2: grpcio sends whole
    messages). Returns (MiB sent, streams reset by moed, moed's peak RSS MiB)."""
    live, reset, peak = [], 0, 0
    for _ in range(conns):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        h = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        h.initiate_connection()
        sent = {}
        for _ in range(streams):
            sid = h.get_next_available_stream_id()
            h.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":authority", "moed"),
                                 (":path", "/inference.GRPCInferenceService/ModelInfer"),
                                 ("content-type", "application/grpc"), ("te", "trailers")])
            h.send_data(sid, b"\0" + (512 << 20).to_bytes(4, "big"))  # uncompressed, 512 MiB
            sent[sid] = 0
        sock.sendall(h.data_to_send())
        sock.setblocking(False)
        live.append((sock, h, sent))
    chunk, total, t0 = bytes(16384), 0, time.monotonic()
    while time.monotonic() - t0 < seconds and any(any(n < each for n in sent.values()) for _, _, sent in live):
        for sock, h, sent in live:
            try:
                for ev in h.receive_data(sock.recv(1 << 20)):
                    if isinstance(ev, h2.events.StreamReset):
                        reset += 1
                        sent.pop(ev.stream_id, None)
            except (BlockingIOError, ConnectionError):
                pass
            for sid in list(sent):
                while sent[sid] < each and min(h.local_flow_control_window(sid), h.max_outbound_frame_size) >= len(chunk):
                    h.send_data(sid, chunk)
                    sent[sid] += len(chunk)
                    total += len(chunk)
            try:
                sock.setblocking(True)
                sock.sendall(h.data_to_send())
                sock.setblocking(False)
            except OSError:
                pass
        peak = max(peak, rss_mib(pid))
        time.sleep(0.02)
    peak = max(peak, rss_mib(pid))
    for sock, _, _ in live:
        sock.close()
    return total >> 20, reset, peak


def test_grpc_memory_quota(tmp):
    quota = 64
    with moed(tmp, "--grpc-memory-bytes", str(quota << 20)) as (p, g, h):
        rss0 = rss_mib(p.pid)
        sent, reset, peak = partial_streams(g, p.pid, 2, 20, 16 << 20, 30)
        # AddressSanitizer keeps freed blocks in its quarantine (256 MiB) and adds its shadow: 343 MiB
        # measured; unbounded, all 640 MiB are taken in
        bound = 2 * quota + (384 if os.environ.get("MOE_SANITIZED") else 0)
        check(reset > 0 and sent < 640 and peak - rss0 < bound,
              f"40 streams of partial 16 MiB messages: {reset} reset by moed, RSS {rss0} -> {peak} MiB at most "
              f"(< {bound}; quota {quota} MiB; {sent} of 640 MiB sent)")
        check(health(g) == SERVING, "gRPC health passes after it")
        ch = grpc.insecure_channel(f"127.0.0.1:{g}")
        try:
            code, msg = code_of(lambda: infer_pb(ch, request(16), timeout=30))
            check(code == SC.OK, f"a call is answered after it ({code} {msg})")
        finally:
            ch.close()


if __name__ == "__main__":
    run_tests(test_metrics_port_flood, test_grpc_body_budget, test_grpc_memory_quota)
