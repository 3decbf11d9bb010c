"""Integration test: what an outside attacker found (tests that failed
before their fix; each names the defect).

- A ModelInfer message may give model_name twice; protobuf-c decodes the
  last one. The inline fast path (small unbatched calls of ops without
  weights run on the gRPC thread) chose by the first one: a message naming
  a cheap op first and an expert set last ran the expert set's fused_moe on
  the one gRPC thread, and every other call, probes included, waited for it.
- REST JSON bodies with bytes after the value (`{...} junk`) were taken
  (cJSON stops at the value's end); a shape dimension past 2^53 was read
  as a double (inexact) and answered as `2.305843009213694e+18`.
- An unknown REST path with another method than GET was 405 "this endpoint
  takes GET" (as was POST on a model's unknown action); Triton's trace and
  logging extensions (tritonclient's get/update_trace_settings and
  get/update_log_settings) were 404 over REST and "unknown method" over
  gRPC: now 501 / UNIMPLEMENTED naming the extension; other unknown gRPC
  methods are named.
- A gRPC input with typed contents in two fields (fp32_contents and
  int_contents) ran on one of them, the other dropped silently.
- ModelStatistics for a version moed does not have answered version 1's
  statistics (metadata and config answer NOT_FOUND naming the version).
- Loads of one expert set at once (two workers each running one): the
  first wrote its log line from the set after inserting it, and the second
  had meanwhile replaced and freed it (heap-use-after-free under ASan).
- ModelStatistics answered with the names of the models it read, packed
  after the repository's lock was dropped: an unload in between freed the
  name (heap-use-after-free under ASan).
- A request string that is not UTF-8 (an id, a parameter's value) was
  taken and echoed into the answer (the id, an error message naming the
  value): proto3 strings are UTF-8, so stock clients' protobuf refused the
  answer ("Exception deserializing response") and their stream ended. Now
  refused as a NUL is, naming the field.
- RepositoryModelUnload (gRPC and REST) of a name that is not a valid
  model name ('../x', one with a newline, 300 characters) was NOT_FOUND
  echoing the name whole ("model 'a\nb' is not loaded"), where every other
  RPC taking a name (the load included) refuses it as INVALID_ARGUMENT
  naming the field, without echoing it (server.md's validation table).
- An ExpertStore upload whose client sends its header and then nothing
  (no deadline, its connection alive) held its --max-uploads slot and its
  budget bytes for good: --max-uploads such clients stopped every upload.
  Now ended with DEADLINE_EXCEEDED after --idle-timeout without a message.

env: MOED, MOEC, MOE_LIB, MOE_MKSET."""
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import tritonclient.grpc as tc
import tritonclient.http as th
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

sys.path.insert(0, os.path.dirname(__file__))
from moed_process import check, moed, run_tests  # noqa: E402
from test_fused_moe import mkset, upload_msgs  # noqa: E402
from test_server import code_of, infer_pb, make_req, raw_unary  # noqa: E402

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


def rest(port, method, path, body=b""):
    """(HTTP status, body text) of one request to the REST port."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body or None, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_rest_strict(tmp):
    x = {"name": "x", "datatype": "FP32", "shape": [2, 64], "data": [0.5] * 128}
    body = json.dumps({"inputs": [x], "parameters": {"format": "mxfp4"}}).encode()
    with moed(tmp) as (_, _g, _h):
        port = _.rest_port
        check(rest(port, "POST", "/v2/models/quant.mx/infer", body)[0] == 200, "REST infer OK")
        for what, path, b in (("infer", "/v2/models/quant.mx/infer", body + b" junk"),
                              ("two objects", "/v2/models/quant.mx/infer", body + body),
                              ("load", "/v2/repository/models/quant.mx/load", b"{} junk")):
            status, text = rest(port, "POST", path, b)
            at = b.rfind(b"junk") if b.endswith(b"junk") else len(body)  # where the bytes after the value begin
            check(status == 400 and f"malformed JSON at byte {at}" in text,
                  f"{what}: bytes after the JSON value: 400 naming where ({status} {text})")
        status, text = rest(port, "POST", "/v2/models/quant.mx/infer", b"{\"inputs\": []}  \r\n")
        check(status == 400 and "malformed" not in text, f"whitespace after the JSON value is no error ({text})")
        big = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [0, 2**62], "data": []}],
                          "parameters": {"format": "mxfp4"}}).encode()
        status, text = rest(port, "POST", "/v2/models/quant.mx/infer", big)
        check(status == 400 and "shape[1]" in text and "2^53" in text,
              f"a dimension past 2^53 (inexact in JSON): 400 naming it ({status} {text})")
        for method, path, want in (("POST", "/v2/nothing", 404), ("DELETE", "/v2/nothing", 404),
                                   ("POST", "/v2/models/quant.mx/bogus", 404),
                                   ("GET", "/v2/repository/bogus", 404),
                                   ("POST", "/v2/models/quant.mx/config", 405), ("DELETE", "/v2", 405),
                                   ("GET", "/v2/repository/index", 405),
                                   ("GET", "/v2/trace/setting", 501), ("POST", "/v2/trace/setting", 501),
                                   ("GET", "/v2/models/quant.mx/trace/setting", 501),
                                   ("GET", "/v2/logging", 501), ("POST", "/v2/logging", 501)):
            status, text = rest(port, method, path, b"{}" if method == "POST" else b"")
            named = {404: "no such endpoint", 405: "take", 501: "extension is not implemented by moed"}[want]
            check(status == want and named in text, f"{method} {path}: {want} ({status} {text})")
        status, text = rest(port, "GET", "/v2/models/quant.mx/versions/2/stats")
        check(status == 404 and "no version '2'" in text, f"REST statistics of version 2: 404 ({status} {text})")
        hc = th.InferenceServerClient(f"127.0.0.1:{port}")
        for name, fn in (("get_trace_settings", hc.get_trace_settings), ("get_log_settings", hc.get_log_settings),
                         ("update_log_settings", lambda: hc.update_log_settings({"log_verbose_level": 1}))):
            try:
                fn()
                got = "no error"
            except InferenceServerException as e:
                got = f"{e.status()} {e.message()}"
            check(got.startswith("501 ") and "not implemented" in got, f"tritonclient.http {name}: 501 ({got})")
        hc.close()


def test_grpc_precise(tmp):
    with moed(tmp) as (_, port, _h):
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        gc = tc.InferenceServerClient(f"127.0.0.1:{port}")
        for name, fn, ext in (("get_trace_settings", gc.get_trace_settings, "trace"),
                              ("update_trace_settings", lambda: gc.update_trace_settings("quant.mx", {}), "trace"),
                              ("get_log_settings", gc.get_log_settings, "logging"),
                              ("update_log_settings", lambda: gc.update_log_settings({}), "logging")):
            code, msg = code_of(fn)
            check(code == SC.UNIMPLEMENTED and msg.startswith(f"{ext}: Triton's {ext} extension is not implemented"),
                  f"tritonclient.grpc {name}: UNIMPLEMENTED naming the extension ({code} {msg})")
        code, msg = code_of(lambda: raw_unary(ch, "/inference.GRPCInferenceService/Nope")(b"", timeout=10))
        check(code == SC.UNIMPLEMENTED and msg == "unknown method /inference.GRPCInferenceService/Nope",
              f"an unknown method is named ({code} {msg})")
        r = make_req("quant.mx", [("x", "FP32", [2, 64], b"")], {"format": "mxfp4"})
        del r.raw_input_contents[:]
        r.inputs[0].contents.fp32_contents.extend([0.5] * 128)
        check(code_of(lambda: infer_pb(ch, r))[0] == SC.OK, "fp32_contents alone: OK")
        r.inputs[0].contents.int_contents.extend([7] * 5)
        code, msg = code_of(lambda: infer_pb(ch, r))
        check(code == SC.INVALID_ARGUMENT and "inputs[0] 'x': contents other than contents.fp32_contents" in msg,
              f"fp32_contents and int_contents: INVALID_ARGUMENT naming them ({code} {msg})")
        check(code_of(lambda: gc.get_inference_statistics("quant.mx", "1"))[0] == SC.OK, "statistics of version 1: OK")
        code, msg = code_of(lambda: gc.get_inference_statistics("quant.mx", "2"))
        check(code == SC.NOT_FOUND and msg == "version: model 'quant.mx' has no version '2'",
              f"statistics of version 2: NOT_FOUND naming it ({code} {msg})")
        gc.close()
        ch.close()


def test_concurrent_loads(tmp):
    repo = os.path.join(tmp, "repo-loads")
    mkset(f"{repo}/loaded", "bf16")
    # more workers than cores: a worker is preempted between its insert and its log line
    with moed(tmp, "--model-repository", repo, "--workers", "8") as (p, port, _h):
        req = pb.RepositoryModelLoadRequest(model_name="loaded").SerializeToString()
        codes = []

        def loader():
            ch = grpc.insecure_channel(f"127.0.0.1:{port}")
            load = raw_unary(ch, "/inference.GRPCInferenceService/RepositoryModelLoad")
            for _ in range(60):
                codes.append(code_of(lambda: load(req, timeout=60))[0])
            ch.close()

        threads = [threading.Thread(target=loader) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        check(codes.count(SC.OK) == len(codes), f"{len(codes)} loads of one set at once: every one OK "
              f"({sorted(set(c.name for c in codes))})")
        up = p.poll() is None
        check(up, "moed still up after them")
        check(up and tc.InferenceServerClient(f"127.0.0.1:{port}").is_model_ready("loaded"), "the set is ready")


def test_statistics_during_unloads(tmp):
    repo = os.path.join(tmp, "repo-stats")
    for k in range(4):
        mkset(f"{repo}/churn{k}", "bf16")
    with moed(tmp, "--model-repository", repo, "--workers", "8") as (p, port, _h):
        stop = threading.Event()
        codes = []

        def churn(k):
            ch = grpc.insecure_channel(f"127.0.0.1:{port}")
            load = raw_unary(ch, "/inference.GRPCInferenceService/RepositoryModelLoad")
            unload = raw_unary(ch, "/inference.GRPCInferenceService/RepositoryModelUnload")
            while not stop.is_set():
                unload(pb.RepositoryModelUnloadRequest(model_name=f"churn{k}").SerializeToString(), timeout=60)
                load(pb.RepositoryModelLoadRequest(model_name=f"churn{k}").SerializeToString(), timeout=60)
            ch.close()

        def stats():
            ch = grpc.insecure_channel(f"127.0.0.1:{port}")
            call = raw_unary(ch, "/inference.GRPCInferenceService/ModelStatistics")
            while not stop.is_set():
                codes.append(code_of(lambda: call(b"", timeout=60))[0])
            ch.close()

        threads = [threading.Thread(target=churn, args=(k,)) for k in range(4)] + \
            [threading.Thread(target=stats) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(4)
        stop.set()
        for t in threads:
            t.join()
        check(len(codes) > 0 and codes.count(SC.OK) == len(codes),
              f"{len(codes)} ModelStatistics while sets are unloaded and loaded: every one OK "
              f"({sorted(set(c.name for c in codes))})")
        check(p.poll() is None, "moed still up after them")


def with_bytes(req, placeholder, raw):
    """req serialized with its string `placeholder` replaced by the bytes `raw` (as long: every
    enclosing length stays right)."""
    b = req.SerializeToString()
    assert b.count(placeholder.encode()) == 1 and len(raw) == len(placeholder)
    return b.replace(placeholder.encode(), raw)


def test_not_utf8(tmp):
    with moed(tmp) as (_, port, _h):
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        good = make_req("quant.mx", [("x", "FP32", [2, 64], bytes(512))], {"format": "mxfp4"})
        good.id = "ok"
        good = good.SerializeToString()
        base = make_req("quant.mx", [("x", "FP32", [2, 64], bytes(512))], {"format": "mxfp4"})
        base.id = "IDVALUE"
        bad_id = with_bytes(base, "IDVALUE", b"a\xffbcdef")
        base = make_req("quant.mx", [("x", "FP32", [2, 64], bytes(512))], {"format": "FORMATVALUE"})
        base.id = "p"
        bad_param = with_bytes(base, "FORMATVALUE", b"mxfp4\xc3(abcd")
        infer = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                               response_deserializer=pb.ModelInferResponse.FromString)
        for what, msg, field in (("id", bad_id, "id"), ("a parameter's value", bad_param,
                                                         "parameters[0].value.string_param")):
            code, text = code_of(lambda: infer(msg, timeout=30))
            check(code == SC.INVALID_ARGUMENT and text == f"{field}: not valid UTF-8",
                  f"ModelInfer: {what} not UTF-8 refused naming it ({code} {text})")
        stream = ch.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                  response_deserializer=pb.ModelStreamInferResponse.FromString)
        try:
            got = sorted((r.infer_response.id, r.error_message) for r in stream(iter([bad_id, good, bad_param]),
                                                                                   timeout=30))
        except grpc.RpcError as e:
            got = f"{e.code()} {e.details()}"
        check(got == [("", "id: not valid UTF-8"), ("ok", ""), ("p", "parameters[0].value.string_param: not valid UTF-8")],
              f"a stream: each refusal parses and names its field, the stream goes on ({got})")
        ch.close()


def test_unload_name(tmp):
    with moed(tmp) as (p, port, _h):
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        unload = raw_unary(ch, "/inference.GRPCInferenceService/RepositoryModelUnload")
        for name, path in (("../x", "..%2Fx"), ("a\nb", "a%0Ab"), ("q" * 300, "q" * 300)):
            code, msg = code_of(lambda: unload(pb.RepositoryModelUnloadRequest(model_name=name).SerializeToString(),
                                               timeout=30))
            check(code == SC.INVALID_ARGUMENT and msg.startswith("model_name: not a valid model name") and
                  name not in msg, f"unload of {name[:12]!r}: INVALID_ARGUMENT naming the field, not echoing it "
                  f"({code} {msg[:80]!r})")
            status, text = rest(p.rest_port, "POST", f"/v2/repository/models/{path}/unload", b"{}")
            check(status == 400 and "model_name: not a valid model name" in text and name not in text,
                  f"REST unload of {name[:12]!r}: 400 naming the field ({status} {text[:80]!r})")
        code, msg = code_of(lambda: unload(pb.RepositoryModelUnloadRequest(model_name="nothere").SerializeToString(),
                                           timeout=30))
        check(code == SC.NOT_FOUND and msg == "model 'nothere' is not loaded", f"a valid name not loaded: NOT_FOUND ({msg})")
        ch.close()


def test_upload_stalled(tmp):
    cfg = '{"num_experts": 8, "hidden_size": 128, "intermediate_size": 64}'
    n = 8 * 64 * 128 * 2
    msgs = upload_msgs(("stalled", cfg, False), [("w2", "bf16", [8, 64, 128], n, bytes(n))], chunk=4096)
    with moed(tmp, "--max-uploads", "1", "--idle-timeout", "2") as (p, port, _h):
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        up = ch.stream_unary("/moe.v1.ExpertStore/Upload", request_serializer=lambda b: b,
                             response_deserializer=lambda b: b)
        release = threading.Event()

        def stall():  # the header and a tensor's first chunk, then nothing
            yield msgs[0]
            yield msgs[1]
            release.wait(60)
        t = time.monotonic()
        stalled = up.future(stall())  # no deadline, as an attacker sets none
        time.sleep(0.5)
        code, msg = code_of(lambda: up(iter(msgs), timeout=30))
        check(code == SC.RESOURCE_EXHAUSTED, f"while it is in progress, another upload is refused ({code})")
        try:
            code, msg = code_of(lambda: stalled.result(timeout=15))
        except grpc.FutureTimeoutError:
            code, msg = None, "still in progress after 15 s"
            stalled.cancel()
        waited = time.monotonic() - t
        release.set()
        check(code == SC.DEADLINE_EXCEEDED and "upload: no message for --idle-timeout (2 s)" == msg and waited < 10,
              f"an upload without a message for --idle-timeout is ended, naming the flag ({code} {msg}, "
              f"after {waited:.1f} s)")
        # the status reaches the client as the call is cancelled; the upload frees its slot when the
        # read that the cancel completes comes back (a moment later, longer under ASan): a client told
        # "retry later" retries
        end = time.monotonic() + 5
        while True:
            code, msg = code_of(lambda: up(iter(msgs), timeout=30))
            if code != SC.RESOURCE_EXHAUSTED or time.monotonic() > end:
                break
            time.sleep(0.1)
        check(code == SC.INVALID_ARGUMENT and "w13" in msg,
              f"its slot is free again: the next upload is admitted within 5 s (fails its set check: {code} {msg})")
        check(p.poll() is None, "moed still up")
        ch.close()


if __name__ == "__main__":
    run_tests(test_model_name_twice, test_rest_strict, test_grpc_precise, test_concurrent_loads,
              test_statistics_during_unloads, test_not_utf8, test_unload_name, test_upload_stalled)
