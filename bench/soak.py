#!/usr/bin/env python3
"""A bounded soak of moed (docs/security.md "Soak"; issue 13).

Starts a real moed on loopback with a small model repository (sets made by
moe-mkset) and drives it for --duration seconds from several threads at
once:

  grpc_valid   tritonclient.grpc quant.per_token / quant.per_tensor, raw
               ModelInfer fused_moe on a set that stays loaded and on one
               being unloaded and loaded (NOT_FOUND/UNAVAILABLE allowed there)
  http_valid   tritonclient.http (the REST port) quant.per_token, per_tensor
  invalid      bad shapes, bad datatypes, unknown parameters, unknown models,
               bad names, garbage protobuf bytes (gRPC); garbage JSON, bad
               shapes, unknown paths (REST): each must be refused with the
               status the case names (an OK or another status is a failure)
  cancels      fused_moe calls with a client deadline of a few ms, the
               server-side `timeout` parameter, and calls cancelled by the
               client while they run
  streams      ModelStreamInfer streams with valid and invalid requests,
               half of them reset (cancelled) by the client mid-flight
  repository   RepositoryModelUnload/Load of a set; ExpertStore uploads
               (moec upload --replace) of a good set and of a broken one
  connections  idle TCP connections to the gRPC, REST and metrics ports,
               slowloris requests (a header byte at a time) on both HTTP
               ports, a partial HTTP/2 preface on gRPC: moed must close each
               within its deadline (--handshake-timeout, --idle-timeout)
  probes       /v2/health/ready and /metrics on the metrics port: 200
  prime        for the first --prime seconds, concurrent 256-row fused_moe
               calls (batches up to 2048 rows): the largest the mix makes,
               so that bounded caches are full before the RSS baseline

Every call's outcome is counted: answered OK, refused with a status (gRPC
code or HTTP status) the case allows, or a failure (any other status,
INTERNAL/UNKNOWN, a call that outlived its deadline where none was tiny, a
connection dropped without a status, an idle connection never closed).
UNAVAILABLE and RESOURCE_EXHAUSTED with moed's own message (a full queue)
count as refusals for any call: overload answered with a status. It
samples moed's RSS (/proc/PID/status) and open descriptors (/proc/PID/fd)
every second. At the end it asserts: moed alive and answering health (gRPC
and HTTP), zero failures, RSS at the end under load within --rss-growth-pct
(5) of RSS at the end of the warm-up (medians of 5 samples each), the
descriptor count back to its value before any client connected (+ --fd-slack)
once the clients have closed, and a clean exit on SIGTERM. It prints a
summary (counts per category, RSS and fd samples) and exits 1 on any failed
assertion. moed runs with MALLOC_ARENA_MAX=2 (--malloc-arena-max; why: at
Soak.env).

  .venv/bin/python bench/soak.py --duration 600 [--build build] [-- MOED FLAGS]

tests/integration/test_soak.py runs it for 60 s in ctest."""
import argparse
import collections
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import tritonclient.grpc as tcg
import tritonclient.http as tch
from tritonclient.grpc import service_pb2 as pb

SC = grpc.StatusCode
# a gRPC status that moed did not send: the connection went away under the call
DROPPED = re.compile(r"Socket closed|Connection reset|failed to connect|Broken pipe|recvmsg|Connection refused|"
                     r"Stream removed|GOAWAY|keepalive|EOF", re.I)
# the stable set's shape (fused_moe calls, cancels) and the churned one's
STABLE = dict(experts=16, hidden=256, inter=256, top_k=2)
SMALL = dict(experts=8, hidden=128, inter=64, top_k=2)
HANDSHAKE_S, IDLE_S = 2, 6  # moed's --handshake-timeout and --idle-timeout here
CALL_S = 30                  # deadline of every call that is not meant to be cut short
# moed refusing work it has no room for is an answer with a status, whatever the call
OVERLOAD = (SC.UNAVAILABLE, SC.RESOURCE_EXHAUSTED)
OVERLOAD_MSG = re.compile(r"queue full|in flight|inflight|out of memory|exhausted")


class Tally:
    """Outcomes per category: ok, refused by status, failures (with their first details)."""

    def __init__(self):
        self.mu = threading.Lock()
        self.ok = collections.Counter()
        self.refused = collections.defaultdict(collections.Counter)
        self.failed = collections.Counter()
        self.details = []

    def add_ok(self, cat):
        with self.mu:
            self.ok[cat] += 1

    def add_refused(self, cat, status):
        with self.mu:
            self.refused[cat][status] += 1

    def add_failure(self, cat, what):
        with self.mu:
            self.failed[cat] += 1
            if len(self.details) < 30:
                self.details.append(f"{time.strftime('%H:%M:%S')} {cat}: {what}")

    def categories(self):
        return sorted(set(self.ok) | set(self.refused) | set(self.failed))


def grpc_outcome(tally, cat, fn, allowed=(), check=None):
    """Runs fn(); OK (and check(result) true, when given) counts ok, a status in `allowed` refused,
    anything else a failure."""
    try:
        r = fn()
    except grpc.RpcError as e:
        code, msg = e.code(), e.details() or ""
    except tcg.InferenceServerException as e:
        name = str(e.status() or "").replace("StatusCode.", "")
        code, msg = getattr(SC, name, SC.UNKNOWN), e.message() or ""
    else:
        if check is None or check(r):
            tally.add_ok(cat)
        else:
            tally.add_failure(cat, f"OK with a wrong answer: {str(r)[:120]}")
        return
    if (code in allowed or code in OVERLOAD) and not (code == SC.UNAVAILABLE and DROPPED.search(msg)):
        tally.add_refused(cat, code.name)
    else:
        tally.add_failure(cat, f"{code.name}: {msg[:160]}")


def http_outcome(tally, cat, fn, allowed=()):
    """fn() -> HTTP status (or raises): 200 ok, a status in `allowed` refused, else a failure."""
    try:
        status = fn()
    except Exception as e:  # noqa: BLE001 (a transport error of any client library is a failure)
        tally.add_failure(cat, f"{type(e).__name__}: {str(e)[:160]}")
        return
    if status == 200:
        tally.add_ok(cat)
    elif status in allowed:
        tally.add_refused(cat, f"HTTP {status}")
    else:
        tally.add_failure(cat, f"HTTP {status}")


def infer_stub(ch):
    """ModelInfer on channel ch, protobuf messages in and out."""
    return ch.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                          request_serializer=pb.ModelInferRequest.SerializeToString,
                          response_deserializer=pb.ModelInferResponse.FromString)


def make_req(model, inputs, params=None, rid="soak"):
    """inputs: (name, KServe datatype, shape, bytes)."""
    r = pb.ModelInferRequest(model_name=model, id=rid)
    for name, dt, shape, data in inputs:
        t = r.inputs.add()
        t.name, t.datatype = name, dt
        t.shape.extend(shape)
        r.raw_input_contents.append(data)
    for k, v in (params or {}).items():
        if isinstance(v, int):
            r.parameters[k].int64_param = v
        else:
            r.parameters[k].string_param = v
    return r


def bf16_bytes(a):
    return (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()


def moe_req(rng, model, shape, tokens, params=None):
    x = rng.standard_normal((tokens, shape["hidden"])).astype(np.float32)
    logits = rng.standard_normal((tokens, shape["experts"])).astype(np.float32)
    return make_req(model, [("hidden_states", "BF16", [tokens, shape["hidden"]], bf16_bytes(x)),
                            ("router_logits", "FP32", [tokens, shape["experts"]], logits.tobytes())], params)


def moe_answer_ok(tokens, hidden):
    def check(resp):
        return (len(resp.outputs) == 1 and list(resp.outputs[0].shape) == [tokens, hidden] and
                len(resp.raw_output_contents[0]) == tokens * hidden * 2)
    return check


class Soak:
    def __init__(self, a, tmp):
        self.a, self.tmp = a, tmp
        self.tally = Tally()
        self.stop = threading.Event()
        self.samples = []  # (seconds since the start of traffic, RSS KiB, descriptors)
        self.t0 = None

    # ---- moed ------------------------------------------------------------------------------
    def mkset(self, path, shape, seed):
        subprocess.run([self.a.mkset, "--out", path, "--scheme", "bf16", "--experts", str(shape["experts"]),
                        "--hidden", str(shape["hidden"]), "--intermediate", str(shape["inter"]),
                        "--top-k", str(shape["top_k"]), "--seed", str(seed)], check=True, capture_output=True)

    def start(self):
        repo = os.path.join(self.tmp, "repo")
        os.makedirs(repo)
        self.mkset(os.path.join(repo, "stable"), STABLE, 1)
        self.mkset(os.path.join(repo, "churn"), SMALL, 2)
        self.upload_src = os.path.join(self.tmp, "upload-src")
        self.mkset(self.upload_src, SMALL, 3)
        # the same set with a config.json that its tensors do not match: the upload must be refused
        self.upload_bad = os.path.join(self.tmp, "upload-bad")
        shutil.copytree(self.upload_src, self.upload_bad)
        cfg_path = os.path.join(self.upload_bad, "config.json")
        cfg = json.load(open(cfg_path))
        cfg["hidden_size"] = cfg["hidden_size"] * 2
        json.dump(cfg, open(cfg_path, "w"))
        port_file = os.path.join(self.tmp, "ports")
        self.log_path = os.path.join(self.tmp, "moed.log")
        self.log = open(self.log_path, "ab")
        self.p = subprocess.Popen([self.a.moed, "--address", "127.0.0.1", "--grpc-port", "0", "--http-port", "0",
                                   "--rest-port", "0", "--port-file", port_file, "--workers", "2",
                                   "--model-repository", repo, "--handshake-timeout", str(HANDSHAKE_S),
                                   "--idle-timeout", str(IDLE_S), *self.a.moed_args],
                                  stdout=self.log, stderr=self.log, env=self.env())
        for _ in range(400):
            if os.path.exists(port_file) and len(open(port_file).read().split()) == 3:
                self.grpc_port, self.http_port, self.rest_port = map(int, open(port_file).read().split())
                break
            if self.p.poll() is not None:
                raise SystemExit(f"moed exited at start: see {self.log_path}")
            time.sleep(0.05)
        else:
            raise SystemExit("moed did not start")
        self.target = f"127.0.0.1:{self.grpc_port}"

    def env(self):
        """moed's environment: ours, and glibc's arena count (--malloc-arena-max). glibc gives threads
        new arenas, up to 8 per core, and gRPC core adds threads to its pool under load for minutes
        (11 -> 18 here): with the default, RSS rises in steps with them, by ~20 % over the first 90 s
        and flat after (measured); with 2 arenas it is flat once the warm-up has run."""
        env = dict(os.environ)
        if self.a.malloc_arena_max > 0:
            env["MALLOC_ARENA_MAX"] = str(self.a.malloc_arena_max)
        return env

    def proc(self):
        """moed's RSS (KiB) and open descriptors."""
        with open(f"/proc/{self.p.pid}/status") as f:
            st = dict(line.split(":", 1) for line in f if ":" in line)
        self.threads = int(st["Threads"])
        return int(st["VmRSS"].split()[0]), len(os.listdir(f"/proc/{self.p.pid}/fd"))

    # ---- the drivers: each loops until stop, counting every call ----------------------------
    def grpc_valid(self, seed):
        rng = np.random.default_rng(seed)
        cli = tcg.InferenceServerClient(self.target)
        ch = grpc.insecure_channel(self.target)
        infer = infer_stub(ch)
        i = 0
        while not self.stop.is_set():
            i += 1
            kind = i % 4
            if kind in (0, 1):
                model, out = ("quant.per_token", "int8") if kind == 0 else ("quant.per_tensor", "fp8_e4m3fn")
                rows = int(rng.integers(1, 33))
                x = rng.standard_normal((rows, 256)).astype(np.float32)
                inp = tcg.InferInput("x", [rows, 256], "FP32")
                inp.set_data_from_numpy(x)
                grpc_outcome(self.tally, "grpc_valid", lambda: cli.infer(model, [inp], parameters={"out_dtype": out},
                                                                          client_timeout=CALL_S),
                             check=lambda r: r.as_numpy("q") is not None and r.as_numpy("q").shape == (rows, 256))
            elif kind == 2:
                tokens = int(rng.integers(1, 65))
                grpc_outcome(self.tally, "grpc_valid", lambda: infer(moe_req(rng, "stable", STABLE, tokens),
                                                                     timeout=CALL_S),
                             check=moe_answer_ok(tokens, STABLE["hidden"]))
            else:  # the set the repository driver unloads and loads
                tokens = int(rng.integers(1, 17))
                grpc_outcome(self.tally, "grpc_churned_set", lambda: infer(moe_req(rng, "churn", SMALL, tokens),
                                                                           timeout=CALL_S),
                             allowed=(SC.NOT_FOUND, SC.UNAVAILABLE), check=moe_answer_ok(tokens, SMALL["hidden"]))
        cli.close()
        ch.close()

    def http_valid(self, seed):
        rng = np.random.default_rng(seed)
        cli = tch.InferenceServerClient(f"127.0.0.1:{self.rest_port}", network_timeout=CALL_S,
                                        connection_timeout=CALL_S)
        i = 0
        while not self.stop.is_set():
            i += 1
            model, out = ("quant.per_token", "int8") if i % 2 else ("quant.per_tensor", "fp8_e4m3fn")
            rows = int(rng.integers(1, 17))
            x = rng.standard_normal((rows, 128)).astype(np.float32)
            inp = tch.InferInput("x", [rows, 128], "FP32")
            inp.set_data_from_numpy(x, binary_data=bool(i % 3))

            def call():
                try:
                    r = cli.infer(model, [inp], parameters={"out_dtype": out})
                except tch.InferenceServerException as e:
                    return int(e.status() or 0)
                q = r.as_numpy("q")
                return 200 if q is not None and q.shape == (rows, 128) else -1
            http_outcome(self.tally, "http_valid", call)
        cli.close()

    def invalid(self, seed):
        rng = random.Random(seed)
        ch = grpc.insecure_channel(self.target)

        def raw(method):
            return ch.unary_unary(f"/inference.GRPCInferenceService/{method}", request_serializer=lambda b: b,
                                  response_deserializer=lambda b: b)
        infer, meta = raw("ModelInfer"), raw("ModelMetadata")
        x = np.zeros((4, 64), np.float32).tobytes()
        IA, NF = (SC.INVALID_ARGUMENT,), (SC.NOT_FOUND,)
        grpc_cases = [
            ("bad shape", lambda: make_req("quant.per_token", [("x", "FP32", [4, 63], x)], {"out_dtype": "int8"}), IA),
            ("bad dtype", lambda: make_req("quant.per_token", [("x", "INT32", [4, 64], x)], {"out_dtype": "int8"}), IA),
            ("unknown parameter",
             lambda: make_req("quant.per_token", [("x", "FP32", [4, 64], x)], {"out_dtyp": "int8"}), IA),
            ("unknown model", lambda: make_req("no.such.model", [("x", "FP32", [4, 64], x)]), NF),
            ("bad name", lambda: make_req('quant"\nx', [("x", "FP32", [4, 64], x)]), IA),
            ("huge shape", lambda: make_req("quant.per_token", [("x", "FP32", [1 << 40, 1 << 40], x)],
                                            {"out_dtype": "int8"}), IA),
            ("bytes short of the shape",
             lambda: make_req("stable", [("hidden_states", "BF16", [8, STABLE["hidden"]], b"\0" * 100),
                                         ("router_logits", "FP32", [8, STABLE["experts"]], b"\0" * 100)]), IA),
        ]
        i = 0
        while not self.stop.is_set():
            i += 1
            k = i % (len(grpc_cases) + 5)
            if k < len(grpc_cases):
                what, mk, allowed = grpc_cases[k]
                body = mk().SerializeToString()
                grpc_outcome(self.tally, "grpc_invalid", lambda: infer(body, timeout=CALL_S), allowed=allowed)
            elif k == len(grpc_cases):  # garbage where a ModelInferRequest belongs
                body = rng.randbytes(rng.randint(1, 4096))
                grpc_outcome(self.tally, "grpc_invalid", lambda: infer(body, timeout=CALL_S), allowed=IA)
            elif k == len(grpc_cases) + 1:
                body = pb.ModelMetadataRequest(name="a/../b").SerializeToString()
                grpc_outcome(self.tally, "grpc_invalid", lambda: meta(body, timeout=CALL_S), allowed=IA)
            else:
                rest_cases = [("POST", "/v2/models/quant.per_token/infer", rng.randbytes(rng.randint(1, 512)), (400,)),
                              ("POST", "/v2/models/quant.per_token/infer",
                               b'{"inputs":[{"name":"x","datatype":"FP32","shape":[2,3],"data":[1,2]}]}', (400,)),
                              ("GET", "/v2/no/such/path", b"", (404,))]
                method, path, body, allowed = rest_cases[k - len(grpc_cases) - 2]
                http_outcome(self.tally, "http_invalid", lambda: self.http_status(self.rest_port, method, path, body),
                             allowed=allowed)
        ch.close()

    def http_status(self, port, method, path, body=b""):
        rq = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body or None, method=method)
        try:
            with urllib.request.urlopen(rq, timeout=CALL_S) as r:
                r.read()
                return r.status
        except urllib.error.HTTPError as e:
            e.read()
            return e.code

    def cancels(self, seed):
        rng = np.random.default_rng(seed)
        ch = grpc.insecure_channel(self.target)
        infer = infer_stub(ch)
        i = 0
        while not self.stop.is_set():
            i += 1
            tokens = int(rng.integers(64, 513))
            if i % 3 == 0:  # a client deadline of a few ms
                req = moe_req(rng, "stable", STABLE, tokens)
                grpc_outcome(self.tally, "deadline", lambda: infer(req, timeout=float(rng.uniform(0.001, 0.02))),
                             allowed=(SC.DEADLINE_EXCEEDED,))
            elif i % 3 == 1:  # the server-side timeout parameter (microseconds)
                req = moe_req(rng, "stable", STABLE, tokens, {"timeout": int(rng.integers(50, 5000))})
                grpc_outcome(self.tally, "timeout_param", lambda: infer(req, timeout=CALL_S),
                             allowed=(SC.DEADLINE_EXCEEDED,))
            else:  # cancelled by the client while it runs
                req = moe_req(rng, "stable", STABLE, tokens)
                fut = infer.future(req, timeout=CALL_S)
                time.sleep(float(rng.uniform(0, 0.01)))
                if fut.cancel():  # still running: cancelled (else it had its answer already)
                    self.tally.add_refused("client_cancel", "CANCELLED")
                else:
                    grpc_outcome(self.tally, "client_cancel", fut.result)
        ch.close()

    def streams(self, seed):
        rng = np.random.default_rng(seed)
        ch = grpc.insecure_channel(self.target)
        stream = ch.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                  request_serializer=pb.ModelInferRequest.SerializeToString,
                                  response_deserializer=pb.ModelStreamInferResponse.FromString)
        i = 0
        while not self.stop.is_set():
            i += 1
            n = int(rng.integers(2, 9))
            reqs, invalid = [], set()
            for j in range(n):
                tokens = int(rng.integers(1, 129))
                r = moe_req(rng, "stable", STABLE, tokens)
                r.id = f"s{i}.{j}"
                if j % 4 == 3:  # an invalid one: answered in the stream with an error message
                    r.inputs[0].shape[0] = tokens + 1
                    invalid.add(r.id)
                reqs.append(r)
            reset = i % 2 == 0
            call = stream(iter(reqs), timeout=CALL_S)
            got, errors, bad = 0, 0, []
            try:
                for resp in call:
                    rid, msg = resp.infer_response.id, resp.error_message
                    if msg:
                        errors += 1
                        if not (OVERLOAD_MSG.search(msg) or (rid in invalid and "hidden_states" in msg)):
                            bad.append(f"{rid}: {msg[:120]}")
                    elif rid in invalid:
                        bad.append(f"{rid}: an invalid request answered without an error")
                    else:
                        got += 1
                    if reset and got + errors >= 1:
                        call.cancel()  # RST_STREAM mid-flight: the rest of the requests are dropped
                        break
            except grpc.RpcError as e:
                if not (reset and e.code() == SC.CANCELLED):
                    self.tally.add_failure("stream", f"{e.code().name}: {(e.details() or '')[:160]}")
                    continue
            if bad:
                self.tally.add_failure("stream", f"unexpected error messages {bad}")
            elif reset:
                self.tally.add_refused("stream", "reset by the client")
            elif got + errors != n:
                self.tally.add_failure("stream", f"{n} requests, {got + errors} responses")
            else:
                self.tally.add_ok("stream")
        ch.close()

    def repository(self, seed):
        rng = random.Random(seed)
        cli = tcg.InferenceServerClient(self.target)
        i = 0
        while not self.stop.wait(1.0):
            i += 1
            if i % 2:
                grpc_outcome(self.tally, "repository", lambda: cli.unload_model("churn", client_timeout=CALL_S))
            else:
                grpc_outcome(self.tally, "repository", lambda: cli.load_model("churn", client_timeout=CALL_S))
            if i % 5 == 0:
                bad = rng.random() < 0.3
                r = subprocess.run([self.a.moec, "-a", self.target, "--timeout-ms", str(CALL_S * 1000), "upload",
                                    self.upload_bad if bad else self.upload_src, "--name", "uploaded", "--replace"],
                                   capture_output=True, text=True, timeout=CALL_S + 10)
                status = re.search(r"\b(INVALID_ARGUMENT|FAILED_PRECONDITION|ABORTED|RESOURCE_EXHAUSTED)\b",
                                   r.stderr)
                if r.returncode == 0 and not bad:
                    self.tally.add_ok("upload")
                elif r.returncode != 0 and bad and status and status.group(1) == "INVALID_ARGUMENT":
                    self.tally.add_refused("upload", "INVALID_ARGUMENT")
                else:
                    self.tally.add_failure("upload", f"{'bad' if bad else 'good'} set: rc {r.returncode}: "
                                                     f"{r.stderr.strip()[-160:]}")
        cli.close()

    def connections(self, seed):
        """Connections that never finish a request: moed must close each within its deadline."""
        rng = random.Random(seed)
        while not self.stop.is_set():
            socks = []  # (what, socket, seconds moed may take)
            try:
                for port, name in ((self.grpc_port, "grpc"), (self.rest_port, "rest"), (self.http_port, "http")):
                    for _ in range(3):  # nothing sent: --handshake-timeout (gRPC), --idle-timeout (HTTP)
                        socks.append((f"idle {name}", socket.create_connection(("127.0.0.1", port), timeout=5),
                                      (HANDSHAKE_S if name == "grpc" else IDLE_S) + 3))
                s = socket.create_connection(("127.0.0.1", self.grpc_port), timeout=5)
                s.sendall(b"PRI * HTTP/2.0\r\n")  # half a preface
                socks.append(("partial preface grpc", s, HANDSHAKE_S + 3))
                for port, name in ((self.rest_port, "rest"), (self.http_port, "http")):
                    s = socket.create_connection(("127.0.0.1", port), timeout=5)
                    s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: soak\r\n")
                    socks.append((f"slowloris {name}", s, HANDSHAKE_S + 3))
            except OSError as e:
                self.tally.add_failure("connections", f"connect: {e}")
            t0 = time.monotonic()
            pending = list(socks)
            while pending and not self.stop.is_set():
                for item in list(pending):
                    what, s, limit = item
                    if what.startswith("slowloris"):
                        try:
                            s.sendall(b"X" if rng.random() < 0.9 else b"-")  # a header that never ends
                        except OSError:
                            pass
                    s.settimeout(0.05)
                    try:
                        data = s.recv(4096)
                        closed = data == b"" or (what.startswith("slowloris") and data.startswith(b"HTTP/1.1 4"))
                        if data and not closed and not what.endswith("grpc"):
                            self.tally.add_failure("connections", f"{what}: answered {data[:60]!r}")
                            closed = True
                    except socket.timeout:
                        closed = False
                    except OSError:
                        closed = True  # reset by moed
                    if closed:
                        self.tally.add_refused("connections", f"{what.split()[0]} closed by moed")
                        pending.remove(item)
                    elif time.monotonic() - t0 > limit:
                        self.tally.add_failure("connections", f"{what}: still open after {limit} s")
                        pending.remove(item)
                time.sleep(0.25)
            for _, s, _ in socks:
                s.close()

    def probes(self, seed):
        i = 0
        while not self.stop.wait(0.5):
            i += 1
            path = "/metrics" if i % 2 else "/v2/health/ready"
            http_outcome(self.tally, "probes", lambda: self.http_status(self.http_port, "GET", path))

    def prime(self, seed):
        """The warm-up's first seconds: the largest requests of the mix, many at once, so that the
        allocator's and moed's bounded caches (hostmem's kept buffers, glibc's mmap threshold, merged
        batches up to --max-batch-tokens) reach the sizes the mix will ask for before RSS is taken
        as the baseline; without it they reach them by chance, in steps, minutes into the run."""
        rng = np.random.default_rng(seed)
        ch = grpc.insecure_channel(self.target)
        infer = infer_stub(ch)
        reqs = [moe_req(rng, "stable", STABLE, 256) for _ in range(4)]
        end = time.monotonic() + self.a.prime
        while time.monotonic() < end and not self.stop.is_set():
            futs = [infer.future(r, timeout=CALL_S) for r in reqs]  # 2 threads: batches of up to 2048 rows
            for f in futs:
                grpc_outcome(self.tally, "prime", f.result, check=moe_answer_ok(256, STABLE["hidden"]))
        ch.close()

    def sampler(self):
        while not self.stop.wait(1.0):
            if self.p.poll() is not None:
                return
            rss, fds = self.proc()
            self.samples.append((time.monotonic() - self.t0, rss, fds, self.threads))

    # ---- the run ---------------------------------------------------------------------------
    def run(self):
        a = self.a
        self.start()
        time.sleep(0.5)
        _, fd_base = self.proc()
        drivers = [("grpc_valid", self.grpc_valid, 2), ("http_valid", self.http_valid, 1),
                   ("invalid", self.invalid, 1), ("cancels", self.cancels, 1), ("streams", self.streams, 1),
                   ("repository", self.repository, 1), ("connections", self.connections, 1),
                   ("probes", self.probes, 1), ("prime", self.prime, 2)]
        self.t0 = time.monotonic()
        threads = [threading.Thread(target=self.sampler, daemon=True)]
        seed = a.seed
        for name, fn, n in drivers:
            for _ in range(n):
                seed += 1
                threads.append(threading.Thread(target=self.guard, args=(name, fn, seed), daemon=True))
        for t in threads:
            t.start()
        deadline = self.t0 + a.duration
        while time.monotonic() < deadline and self.p.poll() is None:
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        end_load = time.monotonic() - self.t0
        self.stop.set()
        for t in threads:
            t.join(CALL_S + 15)
        hung = [t.name for t in threads if t.is_alive()]
        # the clients are closed: descriptors go back to where they were
        fd_end, waited = None, 0.0
        while self.p.poll() is None and waited < 15:
            _, fd_end = self.proc()
            if fd_end <= fd_base + a.fd_slack:
                break
            time.sleep(0.5)
            waited += 0.5
        return self.verdict(fd_base, fd_end, end_load, hung)

    def guard(self, name, fn, seed):
        """A driver whose own code fails counts one failure and stops (the soak goes on)."""
        try:
            fn(seed)
        except Exception as e:  # noqa: BLE001
            self.tally.add_failure(name, f"driver stopped: {type(e).__name__}: {str(e)[:200]}")

    def verdict(self, fd_base, fd_end, end_load, hung):
        a, tally = self.a, self.tally
        checks = []
        alive = self.p.poll() is None
        checks.append((alive, f"moed alive after {end_load:.0f} s (exit status {self.p.poll()})"))
        if alive:
            health = tcg.InferenceServerClient(self.target)
            try:
                live = health.is_server_live(client_timeout=10) and health.is_server_ready(client_timeout=10)
            except tcg.InferenceServerException:
                live = False
            health.close()
            checks.append((live, "gRPC ServerLive and ServerReady"))
            try:
                ready = self.http_status(self.http_port, "GET", "/v2/health/ready")
            except OSError as e:
                ready = str(e)
            checks.append((ready == 200, f"HTTP /v2/health/ready: {ready}"))
        checks.append((not hung, f"every driver finished ({', '.join(hung) or 'none hung'})"))
        n_fail = sum(tally.failed.values())
        checks.append((n_fail == 0, f"unexpected outcomes: {n_fail}"))
        # RSS: the end under load against the end of the warm-up, 5 samples' medians each
        warm = [s for s in self.samples if s[0] >= a.warmup][:5]
        last = [s for s in self.samples if s[0] <= end_load][-5:]
        if len(warm) == 5 and len(last) == 5 and warm[-1][0] < last[0][0]:
            r0, r1 = statistics.median(s[1] for s in warm), statistics.median(s[1] for s in last)
            growth = 100.0 * (r1 - r0) / r0
            checks.append((growth < a.rss_growth_pct or a.rss_growth_pct <= 0,
                           f"RSS after warm-up {r0 / 1024:.1f} MiB -> {r1 / 1024:.1f} MiB at the end: "
                           f"{growth:+.2f} % (limit {a.rss_growth_pct:g} %{', not checked' if a.rss_growth_pct <= 0 else ''})"))
        else:
            checks.append((False, f"RSS: too few samples after a {a.warmup:g} s warm-up"))
        checks.append((fd_end is not None and fd_end <= fd_base + a.fd_slack,
                       f"descriptors: {fd_base} before the clients, {fd_end} after they closed "
                       f"(slack {a.fd_slack}), at most {max((s[2] for s in self.samples), default=0)} during"))
        if alive:
            self.p.send_signal(signal.SIGTERM)
            try:
                rc = self.p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.p.kill()
                rc = "hung, killed"
            checks.append((rc == 0, f"clean exit on SIGTERM ({rc})"))
        self.log.close()
        text = open(self.log_path, errors="replace").read()
        san = re.findall(r"(AddressSanitizer|LeakSanitizer|ThreadSanitizer|runtime error)[^\n]*", text)
        checks.append((not san, f"no sanitizer report in the log ({san[:2]})"))
        self.summary(checks)
        if not all(ok for ok, _ in checks):
            print(f"--- moed log tail ({self.log_path}) ---\n{text[-3000:]}")
        return all(ok for ok, _ in checks)

    def summary(self, checks):
        t = self.tally
        print(f"\nsoak: {self.a.duration:g} s, warm-up {self.a.warmup:g} s, moed {self.a.moed}")
        print("\n| category | ok | refused (status: count) | failed |\n|---|---:|---|---:|")
        for cat in t.categories():
            ref = ", ".join(f"{k} {v}" for k, v in sorted(t.refused[cat].items()))
            print(f"| {cat} | {t.ok[cat]} | {ref} | {t.failed[cat]} |")
        total = sum(t.ok.values()) + sum(sum(c.values()) for c in t.refused.values()) + sum(t.failed.values())
        print(f"| all | {sum(t.ok.values())} | {sum(sum(c.values()) for c in t.refused.values())} "
              f"| {sum(t.failed.values())} |  ({total} outcomes)")
        if t.details:
            print("\nfailures (first 30):\n" + "\n".join("  " + d for d in t.details))
        s = self.samples
        picks = sorted({int(round(k * (len(s) - 1) / 10)) for k in range(11)}) if s else []
        print("\n| t (s) | RSS (MiB) | fds | threads |\n|---:|---:|---:|---:|")
        for k in picks:
            print(f"| {s[k][0]:.0f} | {s[k][1] / 1024:.1f} | {s[k][2]} | {s[k][3]} |")
        print()
        for ok, what in checks:
            print(("ok   " if ok else "FAIL ") + what)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600, help="seconds of load (default 600)")
    ap.add_argument("--warmup", type=float, default=None,
                    help="seconds before the RSS baseline (default: a fifth of --duration, 20 to 120)")
    ap.add_argument("--prime", type=float, default=10,
                    help="seconds of the largest requests, many at once, at the start of the warm-up (default 10)")
    ap.add_argument("--build", default=os.path.join(here, "..", "build"), help="build directory (default build)")
    ap.add_argument("--moed", default=os.environ.get("MOED"), help="moed binary (env MOED; default BUILD/server/moed)")
    ap.add_argument("--moec", default=os.environ.get("MOEC"), help="moec binary (env MOEC)")
    ap.add_argument("--mkset", default=os.environ.get("MOE_MKSET"), help="moe-mkset binary (env MOE_MKSET)")
    ap.add_argument("--rss-growth-pct", type=float, default=5.0, help="RSS growth allowed after the warm-up; "
                    "0: not checked (sanitizer builds)")
    ap.add_argument("--malloc-arena-max", type=int, default=2,
                    help="MALLOC_ARENA_MAX for moed (default 2; 0: glibc's default, which needs a warm-up of ~120 s)")
    ap.add_argument("--fd-slack", type=int, default=4, help="descriptors above the start allowed at the end")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (moed.log)")
    ap.add_argument("moed_args", nargs="*", help="more moed flags (after --)")
    a = ap.parse_args()
    a.moed = a.moed or os.path.join(a.build, "server", "moed")
    a.moec = a.moec or os.path.join(a.build, "client", "moec")
    a.mkset = a.mkset or os.path.join(a.build, "tools", "moe-mkset")
    if a.warmup is None:
        a.warmup = min(120.0, max(20.0, a.duration / 5))
    tmp = tempfile.mkdtemp(prefix="moed-soak-")
    soak = Soak(a, tmp)
    try:
        ok = soak.run()
    finally:
        if getattr(soak, "p", None) is not None and soak.p.poll() is None:
            soak.p.kill()
        if a.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
