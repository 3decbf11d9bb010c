"""Integration test: connections cannot lock moed out (issue 13).

- gRPC: a TCP connection that never sends its HTTP/2 preface is closed
  after --handshake-timeout.
- gRPC: --max-connection-age closes even a connection that is not idle
  (GOAWAY, then the grace).
- HTTP: a request not whole within --handshake-timeout (slowloris) is
  closed; past --http-max-connections a connection that sends no whole
  request within 250 ms is closed (test_limits.py: one that does is
  served once); both counted in /metrics.
- The REST port's own connection counts in /metrics (port="rest"): open,
  accepted, refused at the cap, closed idle after --idle-timeout.
- Descriptors: under a 96-descriptor limit, a storm of idle connections
  must not make gRPC core's accept fail with EMFILE (after which it never
  accepts again): connections into --fd-reserve are closed at accept, the
  probes say alive but not ready while the storm lasts, and a new client
  is served once the handshake timeout closed the storm's.
- HTTP bodies: --http-body-budget-bytes bounds what all connections hold
  together (a body that would pass it is 503 and closed).
- gRPC calls: --max-open-calls bounds the calls (streams included) open
  at once; the probes' unary checks pass at the cap.

env: MOED, MOEC, MOE_LIB."""
import os
import resource
import socket
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc

sys.path.insert(0, os.path.dirname(__file__))
from moed_process import check, moed, run_tests  # noqa: E402

TIMEOUT_S = 1


def closed_within(sock, limit):
    """Seconds until the peer closed sock (reading whatever it sends), or None."""
    sock.settimeout(0.2)
    t = time.monotonic()
    while time.monotonic() - t < limit:
        try:
            if not sock.recv(4096):
                return time.monotonic() - t
        except socket.timeout:
            continue
        except OSError:
            return time.monotonic() - t
    return None


def http_get(port, path):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return None, str(e)


def metric(port, name):
    _, text = http_get(port, "/metrics")
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def grpc_ok(port):
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(ch).result(timeout=3)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        ch.close()


def test_timeouts_and_cap(tmp):
    with moed(tmp, "--handshake-timeout", str(TIMEOUT_S), "--http-max-connections", "3") as (_, g, h):
        check(http_get(h, "/v2/health/live")[0] == 200, "live: 200 while gRPC answers")
        check(http_get(h, "/v2/health/ready")[0] == 200, "ready: 200 while gRPC answers")
        t0 = time.monotonic()
        idle = [socket.create_connection(("127.0.0.1", g)) for _ in range(8)]
        waits = [closed_within(s, 4 * TIMEOUT_S + 2) for s in idle]  # one after the other:
        waits = [None if w is None else time.monotonic() - t0 for w in waits[:1]] + waits[1:]
        check(all(w is not None for w in waits), f"idle gRPC connections closed by moed ({waits})")
        check(waits[0] is not None and waits[0] >= 0.5 * TIMEOUT_S, "... not before the handshake timeout")
        for s in idle:
            s.close()
        check(grpc_ok(g), "a real gRPC client still connects")

        slow = socket.create_connection(("127.0.0.1", h))
        slow.sendall(b"GET /metr")
        w = closed_within(slow, 4 * TIMEOUT_S + 2)
        check(w is not None and w >= 0.5 * TIMEOUT_S, f"partial HTTP request closed after the timeout ({w})")
        slow.close()
        check(metric(h, 'moed_http_connections_closed_total{port="http",reason="timeout"}') == 1, "timeout counted")

        held = [socket.create_connection(("127.0.0.1", h)) for _ in range(3)]
        time.sleep(0.3)
        extra = socket.create_connection(("127.0.0.1", h))
        w = closed_within(extra, 1.0)
        check(w is not None and w < 0.5, f"a connection past --http-max-connections closed at once ({w})")
        extra.close()
        for s in held:  # their deadline frees the slots
            closed_within(s, 4 * TIMEOUT_S + 2)
            s.close()
        time.sleep(0.2)
        check(metric(h, 'moed_http_connections_closed_total{port="http",reason="refused"}') == 1, "refusal counted")
        check(http_get(h, "/v2/health/live")[0] == 200, "live again once the slots are free")


def test_rest_counts(tmp):
    """The REST port's connections, counted apart from the metrics port's."""
    with moed(tmp, "--idle-timeout", str(TIMEOUT_S), "--http-max-connections", "2") as (p, g, h):
        r = p.rest_port

        def rest(suffix):
            return metric(h, f'moed_http_connections{suffix}{{port="rest"}}')
        check(rest("") == 0 and rest("_accepted_total") == 0, "REST: nothing open or accepted at start")
        held = [socket.create_connection(("127.0.0.1", r)) for _ in range(2)]
        for s in held:  # a keep-alive request each: then idle
            s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            check(s.recv(4096).startswith(b"HTTP/1.1 200"), "REST: a keep-alive request answered")
        check(rest("") == 2, f"REST: 2 connections open ({rest('')})")
        extra = socket.create_connection(("127.0.0.1", r))
        w = closed_within(extra, 1.0)
        check(w is not None and w < 0.5, f"REST: a third connection past --http-max-connections 2 closed ({w})")
        extra.close()
        waits = [closed_within(s, 4 * TIMEOUT_S + 2) for s in held]
        check(all(w is not None for w in waits), f"REST: idle keep-alive connections closed ({waits})")
        for s in held:
            s.close()
        time.sleep(0.2)
        counts = {k: metric(h, f'moed_http_connections_closed_total{{port="rest",reason="{k}"}}')
                  for k in ("refused", "idle", "timeout")}
        check(counts == {"refused": 1, "idle": 2, "timeout": 0}, f"REST: closes counted by reason ({counts})")
        check(rest("") == 0 and rest("_accepted_total") == 2, f"REST: 0 open, 2 accepted ({rest(''), rest('_accepted_total')})")


def test_connection_age(tmp):
    """--max-connection-age: a connection that keeps itself from idling out
    is still asked to go (GOAWAY) and closed after the grace."""
    with moed(tmp, "--idle-timeout", "120", "--max-connection-age", "1",
              "--max-connection-age-grace", "1") as (_, g, _):
        s = socket.create_connection(("127.0.0.1", g))
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\0\0\0\4\0\0\0\0\0")  # preface, empty SETTINGS
        w = closed_within(s, 10)
        check(w is not None and 0.5 < w < 10, f"a connection past its age closed after the grace ({w})")
        s.close()
        check(grpc_ok(g), "new connections still served")


def fd_count(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_fd_reserve(tmp):
    """A storm of idle connections under a 96-descriptor limit: gRPC core's
    listener dies for good once accept4 fails with EMFILE (the old failure:
    no client served again while the probes said 200). moed closes
    connections that would fall into --fd-reserve at accept instead, so the
    listener lives, and the storm's connections (no HTTP/2 preface) are
    closed after --handshake-timeout: a new client is served while the
    storm's sockets are still open on its side."""
    def low_fds():
        resource.setrlimit(resource.RLIMIT_NOFILE, (96, 96))

    hs = 4
    with moed(tmp, "--handshake-timeout", str(hs), "--fd-reserve", "16", preexec_fn=low_fds) as (p, g, h):
        base = fd_count(p.pid)
        storm = []
        for _ in range(160):  # more than the descriptors moed has
            try:
                storm.append(socket.create_connection(("127.0.0.1", g), timeout=2))
            except OSError:
                break
        time.sleep(0.3)
        held = fd_count(p.pid)
        print(f"     descriptors: {base} at start, {held} during a storm of {len(storm)} connections")
        check(len(storm) == 160, "every storm connection reached the listen queue")
        check(held <= 96 - 16 + 2, "connections stay out of the reserve")
        refused = sum(1 for s in storm[-40:] if closed_within(s, 0.1) is not None)
        check(refused == 40, f"connections past the budget closed at once ({refused} of the last 40)")
        # while the storm holds every descriptor up to the reserve: the HTTP port (half the
        # reserve is its) says alive but not ready, and /metrics answers
        live, _ = http_get(h, "/v2/health/live")
        ready, body = http_get(h, "/v2/health/ready")
        check(live == 200 and ready == 503 and "connection limit" in body,
              f"during the storm: live 200, ready 503 at the connection limit ({live}, {ready} {body.strip()!r})")
        check(metric(h, 'moed_http_connections{port="http"}') is not None, "/metrics answers during the storm")
        t = time.monotonic()
        ok = grpc_ok(g)  # while the storm's sockets are open on the client side
        while not ok and time.monotonic() - t < 3 * hs + 5:
            time.sleep(0.5)
            ok = grpc_ok(g)
        print(f"     a new gRPC client {'served' if ok else 'never served'} "
              f"{time.monotonic() - t:.1f} s after the storm")
        check(ok, "a new gRPC client is served (the listener survived the storm)")
        if ok:
            ch = grpc.insecure_channel(f"127.0.0.1:{g}")
            live = ch.unary_unary("/inference.GRPCInferenceService/ServerLive")(b"", timeout=5)
            ch.close()
            check(live == b"\x08\x01", "ServerLive answers live")
        check(http_get(h, "/v2/health/live")[0] == 200, "live: 200")
        check(http_get(h, "/v2/health/ready")[0] == 200, "ready: 200")
        n = metric(h, 'moed_connections_refused_total{reason="reserve"}')
        check(n is not None and n >= 40, f"refusals counted ({n})")
        for s in storm:
            s.close()


def test_no_reserve(tmp):
    """--fd-reserve 0: connections take every descriptor, so accept itself
    fails with EMFILE; moed closes its spare descriptor to take the pending
    connection and close it, and gRPC's listener is rearmed, not dropped."""
    def low_fds():
        resource.setrlimit(resource.RLIMIT_NOFILE, (96, 96))

    with moed(tmp, "--handshake-timeout", "2", "--fd-reserve", "0", preexec_fn=low_fds) as (_, g, h):
        storm = []
        for _ in range(160):
            try:
                storm.append(socket.create_connection(("127.0.0.1", g), timeout=2))
            except OSError:
                break
        time.sleep(0.3)
        refused = sum(1 for s in storm[-40:] if closed_within(s, 0.1) is not None)
        check(refused == 40, f"connections past the limit closed at once ({refused} of the last 40)")
        for s in storm:
            s.close()
        t = time.monotonic()
        ok = grpc_ok(g)
        while not ok and time.monotonic() - t < 10:
            time.sleep(0.5)
            ok = grpc_ok(g)
        check(ok, "a new gRPC client is served after accept failed with EMFILE")
        n = metric(h, 'moed_connections_refused_total{reason="exhausted"}')
        check(n is not None and n >= 40, f"refusals without a descriptor counted ({n})")


def test_body_budget(tmp):
    """--http-body-budget-bytes bounds the request bodies all HTTP connections
    hold together: bodies that stall half-sent cannot add up to connections x
    --max-message-bytes (RSS grew 1.1 GB for four 200 MiB bodies); the one
    that would pass it is answered 503 naming the flag and closed, and once
    the holders are answered the budget is free again."""
    MIB = 1 << 20
    with moed(tmp, "--http-body-budget-bytes", str(64 * MIB), "--handshake-timeout", "30") as (p, _, _):
        head = (f"POST /v2/models/quant.per_token/infer HTTP/1.1\r\nHost: x\r\n"
                f"Content-Length: {40 * MIB}\r\n\r\n").encode()

        def holder(n_mib):
            s = socket.create_connection(("127.0.0.1", p.rest_port), timeout=30)
            s.sendall(head)
            for _ in range(n_mib):
                s.sendall(b" " * MIB)
            return s

        def answer(s):
            try:
                return s.recv(4096)
            except OSError as e:
                return repr(e).encode()
        a = holder(30)  # 30 of its 40 MiB: held (the buffer holds 32 MiB)
        time.sleep(0.5)
        b = socket.create_connection(("127.0.0.1", p.rest_port), timeout=30)
        b.sendall(head)
        try:
            for _ in range(40):
                b.sendall(b" " * MIB)
        except OSError:
            pass  # closed by moed once its answer was out
        got = answer(b)
        check(got.startswith(b"HTTP/1.1 503") and b"--http-body-budget-bytes" in got,
              f"a second body past the budget: 503 naming the flag ({got[:100]})")
        b.close()
        a.sendall(b" " * (10 * MIB))  # the rest of a's body: answered, its bytes released
        got = answer(a)
        check(got.startswith(b"HTTP/1.1 413"), f"the holder's request is read whole and answered (its JSON is over 16 MiB) ({got[:60]})")
        a.close()
        time.sleep(0.5)
        c = holder(40)
        got = answer(c)
        check(got.startswith(b"HTTP/1.1 413"), f"after it, a body of the same size is read again ({got[:60]})")
        c.close()


def test_open_calls(tmp):
    """--max-open-calls bounds the gRPC calls open at once: streams a client
    keeps open (health Watch, an idle ModelStreamInfer) cost gRPC core's call
    state each (20,000 Watch streams grew RSS by 230 MiB, with no bound); past
    the cap a call is RESOURCE_EXHAUSTED naming the flag, the probes' unary
    checks still pass, and a closed stream frees its place."""
    with moed(tmp, "--max-open-calls", "8") as (_, port, _):
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        watch = ch.unary_stream("/grpc.health.v1.Health/Watch", request_serializer=lambda b: b,
                                response_deserializer=lambda b: b)
        stream = ch.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer", request_serializer=lambda b: b,
                                  response_deserializer=lambda b: b)
        meta = ch.unary_unary("/inference.GRPCInferenceService/ServerMetadata", request_serializer=lambda b: b,
                              response_deserializer=lambda b: b)
        held = []
        for _ in range(6):
            it = watch(b"", timeout=60)
            next(it)
            held.append(it)
        stop = threading.Event()

        def nothing():  # a stream that sends nothing until the test ends
            stop.wait(60)
            return
            yield
        idle = [stream(nothing(), timeout=60) for _ in range(2)]
        time.sleep(0.5)
        try:
            next(watch(b"", timeout=10))
            got = "served"
        except grpc.RpcError as e:
            got = f"{e.code().name}: {e.details()}"
        check(got.startswith("RESOURCE_EXHAUSTED: calls: 8 open, at most --max-open-calls 8"),
              f"a ninth call: RESOURCE_EXHAUSTED naming the flag ({got})")
        ready = ch.unary_unary("/inference.GRPCInferenceService/ServerReady", request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)
        check(ready(b"", timeout=10) == b"\x08\x01", "the probes' ServerReady still answers at the cap")
        for it in held[:2] + idle:
            it.cancel()
        time.sleep(1.5)  # cancelled watches leave at the next health sweep (every second)
        try:
            meta(b"", timeout=10)
            got = "OK"
        except grpc.RpcError as e:
            got = f"{e.code().name}: {e.details()}"
        check(got == "OK", f"closed streams free their places ({got})")
        for it in held[2:]:
            it.cancel()
        stop.set()


if __name__ == "__main__":
    run_tests(test_timeouts_and_cap, test_rest_counts, test_connection_age, test_fd_reserve, test_no_reserve,
                 test_body_budget, test_open_calls)
