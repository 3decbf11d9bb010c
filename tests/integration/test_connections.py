"""Integration test: connections cannot lock moed out (issue 13).

- gRPC: a TCP connection that never sends its HTTP/2 preface is closed
  after --handshake-timeout.
- HTTP: a request not whole within --handshake-timeout (slowloris) is
  closed; past --http-max-connections a connection is closed at accept;
  both counted in /metrics.
- The HTTP probes check the gRPC listener: under a descriptor limit, a
  storm of idle connections makes gRPC core's accept fail with EMFILE,
  after which it never accepts again; /v2/health/live and /ready must then
  answer 503 (and 200 whenever a gRPC call still gets through), so that
  Kubernetes restarts the pod instead of routing to it.

env: MOED, MOEC, MOE_LIB."""
import os
import resource
import socket
import sys
import time
import urllib.error
import urllib.request

import grpc

sys.path.insert(0, os.path.dirname(__file__))
import test_server as ts  # noqa: E402
from test_server import check  # noqa: E402

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
    p, g, h = ts.start(tmp, "--handshake-timeout", str(TIMEOUT_S), "--http-max-connections", "3")
    try:
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
        check(metric(h, 'moed_http_connections_closed_total{reason="timeout"}') == 1, "timeout counted")

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
        check(metric(h, 'moed_http_connections_closed_total{reason="refused"}') == 1, "refusal counted")
        check(http_get(h, "/v2/health/live")[0] == 200, "live again once the slots are free")
    finally:
        ts.stop(p)


def test_listener_check(tmp):
    def low_fds():
        resource.setrlimit(resource.RLIMIT_NOFILE, (96, 96))

    p, g, h = ts.start(tmp, "--handshake-timeout", "60", preexec_fn=low_fds)
    try:
        storm = []
        for _ in range(160):  # more than the descriptors: accept4 fails with EMFILE
            try:
                storm.append(socket.create_connection(("127.0.0.1", g), timeout=2))
            except OSError:
                break
        time.sleep(1.0)
        for s in storm:
            s.close()
        time.sleep(1.0)
        ok = grpc_ok(g)
        live, body = http_get(h, "/v2/health/live")
        ready, _ = http_get(h, "/v2/health/ready")
        print(f"     after the storm: gRPC {'answers' if ok else 'stuck'}, live {live} {body.strip()!r}, "
              f"ready {ready}")
        check(live == (200 if ok else 503), "live tells whether the gRPC listener answers")
        check(ready == (200 if ok else 503), "ready tells it too")
    finally:
        ts.stop(p)


if __name__ == "__main__":
    ts.run_tests(test_timeouts_and_cap, test_listener_check)
