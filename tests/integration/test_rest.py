"""Integration test: the KServe v2 REST API (server/rest.c) of a real moed
on a free loopback port, called by stock tritonclient.http and compared
with the same calls through tritonclient.grpc: health, server and model
metadata, model config, readiness, repository index/load/unload,
statistics, and inference on a quant op and on expert sets with JSON and
binary tensors (outputs bit-identical to gRPC's); then the HTTP errors
(status and the field the message names) and the connection limits, with
raw requests.

env: MOED, MOEC, MOE_LIB, MOE_MKSET."""
import http.client
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np
import tritonclient.grpc as tc
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

sys.path.insert(0, os.path.dirname(__file__))
from moed_process import check, exit_with_summary, moed, print_log_tail  # noqa: E402
from long_call import bigset_repo, blocker, call_fn, channel, metric_values, wait_metric  # noqa: E402

MKSET = os.environ["MOE_MKSET"]
HIDDEN, EXPERTS = 128, 8
URL = [""]  # the REST port's host:port, once moed runs


def mkset(path, scheme):
    subprocess.run([MKSET, "--out", path, "--scheme", scheme, "--experts", str(EXPERTS), "--hidden", str(HIDDEN),
                    "--intermediate", "64", "--top-k", "2"], check=True, capture_output=True)


def http_error(fn):
    """(HTTP status, message) of a tritonclient.http call that must fail."""
    try:
        fn()
        return None, ""
    except InferenceServerException as e:
        return e.status(), e.message()


def raw(port, method, path, body=b"", headers=None):
    """One request on a fresh connection: (status, headers, body bytes)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request(method, path, body=body, headers=headers or {})
    r = c.getresponse()
    out = (r.status, dict(r.getheaders()), r.read())
    c.close()
    return out


def error_of(port, method, path, body=b"", headers=None):
    status, _, data = raw(port, method, path, body, headers)
    try:
        return status, json.loads(data)["error"]
    except (ValueError, KeyError):
        return status, data.decode(errors="replace")


def tensor_shapes(ts_):
    return {t["name"]: (t["datatype"], [int(d) for d in t["shape"]]) for t in ts_}


# ---- metadata, config, health ------------------------------------------------------------


def test_server(h, g):
    check(h.is_server_live() and h.is_server_ready(), "REST server live and ready")
    hm, gm = h.get_server_metadata(), g.get_server_metadata(as_json=True)
    check(hm["name"] == gm["name"] == "moed" and hm["version"] == gm["version"]
          and hm["extensions"] == gm["extensions"], f"server metadata as over gRPC ({hm})")


def test_models(h, g, port):
    for model in ("quant.per_tensor", "bf16set"):
        hm, gm = h.get_model_metadata(model), g.get_model_metadata(model, as_json=True)
        same = (hm["name"] == gm["name"] and hm["versions"] == gm["versions"] and hm["platform"] == gm["platform"]
                and tensor_shapes(hm["inputs"]) == tensor_shapes(gm["inputs"])
                and tensor_shapes(hm["outputs"]) == tensor_shapes(gm["outputs"]))
        check(same, f"{model}: REST metadata as over gRPC ({tensor_shapes(hm['inputs'])})")
        hc, gc = h.get_model_config(model), g.get_model_config(model, as_json=True)["config"]
        dims = lambda c: [(i["name"], i["data_type"], [int(d) for d in i["dims"]], i.get("optional", False))  # noqa
                          for i in c["input"]]
        check(hc["name"] == model and hc.get("max_batch_size", 0) == gc.get("max_batch_size", 0)
              and dims(hc) == dims(gc), f"{model}: REST config as over gRPC ({dims(hc)})")
    check(h.get_model_metadata("quant.per_tensor", "1")["name"] == "quant.per_tensor", "metadata of version 1")
    check(h.is_model_ready("quant.per_tensor") and h.is_model_ready("bf16set", "1"), "models ready")
    check(not h.is_model_ready("nope") and not h.is_model_ready("quant.per_tensor", "2"),
          "unknown model / version: not ready")
    status, msg = error_of(port, "GET", "/v2/models/nope/ready")
    check(status == 400 and "'nope'" in msg, f"readiness of an unknown model: 400 naming it ({status} {msg})")
    status, msg = http_error(lambda: h.get_model_metadata("nope"))
    check(status == "404" and "'nope'" in msg, f"metadata of an unknown model: 404 naming it ({status} {msg})")
    status, msg = http_error(lambda: h.get_model_config("quant.per_tensor", "7"))
    check(status == "404" and "version" in msg and "'7'" in msg, f"config of version 7: 404 ({status} {msg})")


def test_repository(h, g):
    idx = {m["name"]: m for m in h.get_model_repository_index()}
    check(idx.get("bf16set", {}).get("state") == "READY" and "quant.per_tensor" in idx,
          f"repository index lists sets and built-ins ({sorted(idx)})")
    h.unload_model("bf16set")
    check(not h.is_model_ready("bf16set") and not g.is_model_ready("bf16set"), "unloaded over REST: not ready")
    idx = {m["name"]: m for m in h.get_model_repository_index()}
    check(idx.get("bf16set", {}).get("state") == "UNAVAILABLE", f"index after unload ({idx.get('bf16set')})")
    h.load_model("bf16set")
    check(h.is_model_ready("bf16set") and g.is_model_ready("bf16set"), "loaded over REST: ready on both ports")
    status, msg = http_error(lambda: h.load_model("bf16set", config='{"max_batch_size": 8}'))
    check(status == "400" and "config" in msg, f"load with a config override: 400 naming it ({status} {msg})")
    status, msg = http_error(lambda: h.load_model("nosuchset"))
    check(status == "404" and "nosuchset" in msg, f"load of a missing set: 404 naming it ({status} {msg})")


# ---- inference --------------------------------------------------------------------------------


def grpc_infer(g, model, arrays, outputs):
    return grpc_infer_params(g, model, arrays, outputs, None)


def grpc_infer_params(g, model, arrays, outputs, params):
    ins = []
    for name, (a, dt) in arrays.items():
        i = tc.InferInput(name, list(a.shape), dt)
        i.set_data_from_numpy(a)
        ins.append(i)
    r = g.infer(model, ins, outputs=[tc.InferRequestedOutput(o) for o in outputs], parameters=params)
    return {o: r.as_numpy(o) for o in outputs}


def http_infer(h, model, arrays, outputs, binary_in, binary_out):
    ins = []
    for name, (a, dt) in arrays.items():
        i = th.InferInput(name, list(a.shape), dt)
        i.set_data_from_numpy(a, binary_data=binary_in(name))
        ins.append(i)
    r = h.infer(model, ins, outputs=[th.InferRequestedOutput(o, binary_data=binary_out) for o in outputs])
    return {o: r.as_numpy(o) for o in outputs}


def same(a, b):
    return all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes() for k in a)


def test_infer(h, g):
    rng = np.random.default_rng(7)
    # a quant op: JSON and binary both ways; a large input (decoded on a worker)
    for rows, cols in ((8, 64), (1024, 512)):
        x = {"x": (rng.standard_normal((rows, cols)).astype(np.float32), "FP32")}
        want = grpc_infer(g, "quant.per_tensor", x, ["q", "scale"])
        for bin_in in (False, True):
            for bin_out in (False, True):
                got = http_infer(h, "quant.per_tensor", x, ["q", "scale"], lambda _: bin_in, bin_out)
                check(same(got, want), f"quant.per_tensor [{rows}, {cols}] binary in {bin_in} out {bin_out}: "
                                       "bit-identical to gRPC")
    # no outputs named: every output comes back binary (tritonclient asks binary_data_output)
    x = {"x": (rng.standard_normal((4, 32)).astype(np.float32), "FP32")}
    i = th.InferInput("x", [4, 32], "FP32")
    i.set_data_from_numpy(x["x"][0])
    r = h.infer("quant.per_tensor", [i])
    want = grpc_infer(g, "quant.per_tensor", x, ["q", "scale"])
    check(same({k: r.as_numpy(k) for k in want}, want), "quant.per_tensor, all outputs by default: bit-identical")
    # expert sets: bf16 activations binary (the client sends BF16 only so), fp32 logits as JSON
    t = 6
    lg = rng.standard_normal((t, EXPERTS)).astype(np.float32)
    xb = rng.standard_normal((t, HIDDEN)).astype(ml_dtypes.bfloat16)
    arr = {"hidden_states": (xb, "BF16"), "router_logits": (lg, "FP32")}
    want = grpc_infer(g, "bf16set", arr, ["output"])
    got = http_infer(h, "bf16set", arr, ["output"], lambda n: n == "hidden_states", True)
    check(got["output"].tobytes() == want["output"].tobytes() and len(got["output"].tobytes()) == t * HIDDEN * 2,
          "fused_moe bf16 set: bit-identical to gRPC")
    # fp16 set, every tensor JSON (fp16 numbers are exact as JSON)
    xh = rng.standard_normal((t, HIDDEN)).astype(np.float16)
    arr = {"hidden_states": (xh, "FP16"), "router_logits": (lg, "FP32")}
    want = grpc_infer(g, "fp16set", arr, ["output"])
    got = http_infer(h, "fp16set", arr, ["output"], lambda _: False, False)
    check(same(got, want), "fused_moe fp16 set, JSON tensors: bit-identical to gRPC")
    # statistics: what gRPC counts, REST reads
    hs = h.get_inference_statistics("quant.per_tensor")["model_stats"][0]["inference_stats"]
    gs = g.get_inference_statistics("quant.per_tensor").model_stats[0].inference_stats
    check(hs["success"]["count"] == gs.success.count >= 11 and hs["compute_infer"]["count"] == gs.compute_infer.count,
          f"statistics over REST as over gRPC ({hs['success']['count']} successes)")
    durations = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit",
                 "cache_miss")
    check(all(hs[d] == {"count": hs[d]["count"], "ns": hs[d]["ns"]} for d in durations)
          and hs["cache_hit"] == {"count": 0, "ns": 0},
          f"REST statistics carry every duration as Triton's do, cache_hit/miss at zero ({sorted(hs)})")
    every = {m["name"] for m in h.get_inference_statistics()["model_stats"]}
    check({"quant.per_tensor", "bf16set", "fp16set"} <= every, "statistics of every model")
    # concurrent requests on a batched op (quant.mx merges rows): through the batcher, each its own answer
    h4 = th.InferenceServerClient(URL[0], concurrency=4)
    xs = [rng.standard_normal((2 + k % 3, 64)).astype(np.float32) for k in range(16)]
    reqs = []
    for a in xs:
        ii = th.InferInput("x", list(a.shape), "FP32")
        ii.set_data_from_numpy(a)
        reqs.append(h4.async_infer("quant.mx", [ii], parameters={"format": "mxfp4"}))
    ok = True
    for a, fut in zip(xs, reqs):
        want = grpc_infer_params(g, "quant.mx", {"x": (a, "FP32")}, ["q", "scales"], {"format": "mxfp4"})
        r = fut.get_result()
        ok = ok and all(r.as_numpy(k).tobytes() == want[k].tobytes() for k in want)
    h4.close()
    check(ok, "16 concurrent quant.mx requests over 4 connections: each bit-identical to gRPC")
    status, msg = http_error(lambda: h.infer("nope", [i]))
    check(status == "404" and "'nope'" in msg, f"infer on an unknown model: 404 naming it ({status} {msg})")



def test_nonfinite_json(h, g, port):
    """NaN, the infinities and -0.0 as JSON tensors, both ways: tritonclient
    (through Python's json) writes and reads NaN / Infinity / -Infinity, and
    -0.0 must come back a float (cJSON's "-0" parses as the integer 0)."""
    x = np.array([[1.0, np.nan, np.inf, -np.inf, -0.0, 3.0, 0.0, -2.0]], np.float32)
    want = grpc_infer(g, "quant.per_token", {"x": (x, "FP32")}, ["q", "scales"])
    for bin_out in (False, True):
        got = http_infer(h, "quant.per_token", {"x": (x, "FP32")}, ["q", "scales"], lambda _: False, bin_out)
        check(same(got, want), f"non-finite FP32 values sent as JSON (answer binary {bin_out}): as over gRPC")
    # outputs that are inf, -inf, NaN and -0.0 (mxfp8_e5m2 codes 0x7c, 0xfc, 0x7e, 0x80; scale 2^0)
    q = np.zeros((1, 32), np.uint8)
    q[0, :4] = [0x7C, 0xFC, 0x7E, 0x80]
    arr = {"q": (q, "UINT8"), "scales": (np.full((1, 1), 127, np.uint8), "UINT8")}
    want = grpc_infer_params(g, "dequant.mx", arr, ["y"], {"format": "mxfp8_e5m2"})["y"]
    ins = []
    for name, (a, dt) in arr.items():
        i = th.InferInput(name, list(a.shape), dt)
        i.set_data_from_numpy(a, binary_data=False)
        ins.append(i)
    got = h.infer("dequant.mx", ins, parameters={"format": "mxfp8_e5m2"},
                  outputs=[th.InferRequestedOutput("y", binary_data=False)]).as_numpy("y")
    check(np.isposinf(got[0, 0]) and np.isneginf(got[0, 1]) and np.isnan(got[0, 2]),
          f"inf, -inf, NaN answered as JSON: read back as such ({got[0, :3]})")
    check(got[0, 3] == 0 and np.signbit(got[0, 3]) and np.array_equal(np.signbit(got), np.signbit(want)),
          "-0.0 answered as JSON keeps its sign, as over gRPC")
    # the tokens only stand for values: in a string or as part of a word they are not rewritten
    status, body = error_of(port, "POST", "/v2/models/quant.per_token/infer",
                            b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,1],"data":[NaNa]}]}')
    check(status == 400 and "malformed JSON" in body, f"NaNa is no number: 400 malformed ({status} {body})")
    status, body = error_of(port, "POST", "/v2/models/quant.per_token/infer",
                            b'{"inputs":[{"name":"x","datatype":"INT32","shape":[1,1],"data":[NaN]}]}')
    check(status == 400 and "data[0]" in body, f"NaN for an INT32 input: 400 naming data[0] ({status} {body})")

# ---- errors and limits, raw ----------------------------------------------------------------------


def test_errors(port):
    path = "/v2/models/quant.per_tensor/infer"
    x = {"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [1, 2, 3, 4]}
    # a message that quotes bytes of the request that are not UTF-8 (a path,
    # an input's name) is still UTF-8 JSON: those bytes become '?'
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"GET /v2/x\xff\xc3y HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    s.close()
    body = data.partition(b"\r\n\r\n")[2]
    try:
        msg = json.loads(body.decode("utf-8"))["error"]
    except (UnicodeDecodeError, ValueError, KeyError) as e:
        msg = f"not UTF-8 JSON: {e!r} {body!r}"
    check(data.startswith(b"HTTP/1.1 404") and msg == "no such endpoint: /v2/x??y",
          f"a path with bytes that are not UTF-8: 404 in UTF-8 JSON ({msg})")
    status, _, body = raw(port, "POST", path, b'{"inputs": [{"name": "\xe2\x82", "datatype": 5}]}')
    try:
        msg = json.loads(body.decode("utf-8"))["error"]
    except (UnicodeDecodeError, ValueError, KeyError) as e:
        msg = f"not UTF-8 JSON: {e!r} {body!r}"
    check(status == 400 and msg.startswith("inputs[0] '??': datatype"),
          f"an input name that is not UTF-8: 400 in UTF-8 JSON ({status} {msg})")
    # a parameter twice in the JSON object: refused as such, not as unknown to the op
    status, msg = error_of(port, "POST", "/v2/models/quant.per_token/infer",
                           b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}],'
                           b' "parameters": {"out_dtype": "int8", "out_dtype": "fp8_e4m3fn"}}')
    check(status == 400 and msg == "parameters['out_dtype']: given twice", f"a parameter twice: 400 ({status} {msg})")
    status, msg = error_of(port, "GET", "/v2/models/%E2%82%AC/ready")  # a valid character, decoded: kept
    check(status == 400 and msg.startswith("name: not a valid model name"), f"a euro sign as a name: 400 ({msg})")
    status, msg = error_of(port, "POST", path, b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [2,')
    check(status == 400 and "malformed JSON" in msg, f"malformed JSON: 400 ({status} {msg})")
    status, msg = error_of(port, "POST", path, json.dumps({"inputs": [dict(x, datatype="INT32")]}).encode())
    check(status == 400 and "x" in msg and "int32" in msg, f"wrong datatype: 400 naming x and int32 ({status} {msg})")
    status, msg = error_of(port, "POST", path, json.dumps({"inputs": [dict(x, datatype="FP64")]}).encode())
    check(status == 400 and "'x'" in msg and "FP64" in msg, f"a datatype moed lacks: 400 naming it ({status} {msg})")
    status, msg = error_of(port, "POST", path, json.dumps({"inputs": [dict(x, data=[1, 2, 3])]}).encode())
    check(status == 400 and "'x'" in msg and "3 elements" in msg, f"short data: 400 ({status} {msg})")
    status, msg = error_of(port, "POST", path, json.dumps({"inputs": [dict(x, data=[1, 2, "a", 4])]}).encode())
    check(status == 400 and "data[2]" in msg, f"a string in data: 400 naming data[2] ({status} {msg})")
    status, msg = error_of(port, "POST", path, json.dumps({"input": [x]}).encode())
    check(status == 400 and "inputs" in msg, f"no inputs: 400 naming inputs ({status} {msg})")
    status, msg = error_of(port, "POST", path, json.dumps(
        {"inputs": [x], "outputs": [{"name": "q", "parameters": {"binary_data": "yes"}}]}).encode())
    check(status == 400 and msg.endswith("'q': parameters.binary_data: not a boolean"),
          f"binary_data not a boolean: 400 saying so ({status} {msg})")
    # binary data that the body does not hold
    head = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [10, 10],
                                   "parameters": {"binary_data_size": 400}}],
                       "parameters": {"binary_data_output": True}}).encode()
    hdr = {"Inference-Header-Content-Length": str(len(head))}
    status, msg = error_of(port, "POST", path, head + bytes(100), hdr)
    check(status == 400 and "binary_data_size" in msg and "'x'" in msg,
          f"truncated binary data: 400 naming x's binary_data_size ({status} {msg})")
    status, msg = error_of(port, "POST", path, head + bytes(500), hdr)
    check(status == 400 and "binary data" in msg, f"extra binary data: 400 ({status} {msg})")
    status, msg = error_of(port, "POST", path, head, {"Inference-Header-Content-Length": str(len(head) + 1)})
    check(status == 400 and "Inference-Header-Content-Length" in msg, f"header length past the body: 400 ({msg})")
    # a valid binary request, raw: the answer's header length splits JSON and data
    xb = np.arange(100, dtype=np.float32) - 50
    status, hd, data = raw(port, "POST", path, head + xb.tobytes(), hdr)
    n = int(hd.get("Inference-Header-Content-Length", -1))
    j = json.loads(data[:n]) if status == 200 else {}
    sizes = [o["parameters"]["binary_data_size"] for o in j.get("outputs", []) if "parameters" in o]
    check(status == 200 and sum(sizes) == len(data) - n == 104,
          f"binary outputs follow the JSON header ({status}, sizes {sizes})")
    status, msg = error_of(port, "GET", path)
    check(status == 405 and "POST" in msg, f"GET on infer: 405 ({status} {msg})")
    status, msg = error_of(port, "GET", "/v2/nothing/here")
    check(status == 404 and "/v2/nothing/here" in msg, f"an unknown endpoint: 404 naming it ({status} {msg})")
    status, msg = error_of(port, "POST", "/v2/repository/models/quant.per_tensor/unload",
                           json.dumps({"parameters": {"force": True}}).encode())
    check(status == 400 and "force" in msg, f"unload with an unknown parameter: 400 naming it ({status} {msg})")


def test_limits(port, side):
    # a body over --max-message-bytes: 413 as soon as its length is known, before the body
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"POST /v2/models/quant.per_tensor/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n")
    got = s.recv(4096)
    s.close()
    check(got.startswith(b"HTTP/1.1 413") and b"max-message-bytes" in got, f"body too large: 413 ({got[:60]})")
    # Expect: 100-continue (curl's, for bodies over 1 KiB): answered before the body is sent
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
    got = s.recv(4096)
    s.sendall(b"{}")
    rest = s.recv(65536)
    s.close()
    check(got.startswith(b"HTTP/1.1 100 Continue") and b"200 OK" in got + rest, f"Expect: 100-continue ({got[:30]})")
    # keep-alive: two requests on one connection
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/v2/health/live")
    r1 = c.getresponse()
    r1.read()
    c.request("GET", "/v2")
    r2 = c.getresponse()
    check(r1.status == 200 and r2.status == 200 and json.loads(r2.read())["name"] == "moed",
          "keep-alive: two requests on one connection")
    c.close()
    # two requests in one write (pipelined): both answered, in order
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"GET /v2/models/quant.mx/ready HTTP/1.1\r\nHost: x\r\n\r\n"
              b"GET /v2/models/nope/ready HTTP/1.1\r\nHost: x\r\n\r\n")
    got = b""
    while got.count(b"HTTP/1.1 ") < 2:
        more = s.recv(65536)
        if not more:
            break
        got += more
    s.close()
    check(got.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 400" in got[12:], f"pipelined requests ({got[:40]})")
    # a chunked body
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("POST", "/v2/repository/index", body=iter([b'{"ready"', b': true}']),
              headers={"Transfer-Encoding": "chunked"}, encode_chunked=True)
    r = c.getresponse()
    check(r.status == 200 and all(m["state"] == "READY" for m in json.loads(r.read())), "a chunked request body")
    c.close()
    status, msg = error_of(port, "POST", "/v2/repository/index", b"x", {"Content-Encoding": "gzip"})
    check(status == 415 and "Content-Encoding" in msg, f"a compressed body: 415 ({status} {msg})")
    # a request that stops halfway: closed after --handshake-timeout (1 s here)
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"GET /v2 HTTP/1.1\r\nHost: x\r\n")
    t0 = time.monotonic()
    got = s.recv(4096)
    s.close()
    check(got == b"" and 0.5 < time.monotonic() - t0 < 5, "a half-sent request: closed after the timeout")
    # a body trickled a byte every 0.3 s (each pause under the 1 s timeout): cut off at the body's
    # rate (--http-body-min-rate, 64 KiB/s by default, after a first --handshake-timeout), not after
    # the 300 s its 1000 bytes would take
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
    t0, closed, sent = time.monotonic(), None, 0
    while closed is None and time.monotonic() - t0 < 15:
        try:
            if select.select([s], [], [], 0.3)[0] and s.recv(4096) == b"":
                closed = time.monotonic() - t0
            else:
                sent += s.send(b"x")
        except OSError:
            closed = time.monotonic() - t0
    s.close()
    check(closed is not None and 0.8 < closed < 3.5 and sent < 20,
          f"a trickled body: closed at its rate's deadline ({closed} s, {sent} bytes sent)")
    # a client that never reads its answer (8 MiB of JSON codes): closed once it has taken nothing for
    # --handshake-timeout (1 s), the answer freed, not held for as long as the client stays
    timeouts = 'moed_http_connections_closed_total{port="rest",reason="timeout"}'
    before = sum(metric_values(side, timeouts))
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    x = np.zeros((1024, 2048), np.float32)
    head = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                                   "parameters": {"binary_data_size": x.nbytes}}]}).encode()
    s.sendall(f"POST /v2/models/quant.per_tensor/infer HTTP/1.1\r\nHost: x\r\nInference-Header-Content-Length: "
              f"{len(head)}\r\nContent-Length: {len(head) + x.nbytes}\r\n\r\n".encode() + head + x.tobytes())
    t0 = time.monotonic()
    wait_metric(side, timeouts, before + 1, "a client that never reads its answer: its connection closed")
    t = time.monotonic() - t0
    s.close()
    check(t < 10, f"... within a few --handshake-timeout of the answer ({t:.2f}s)")


def test_drain(tmp):
    """SIGTERM with a REST request held by the batcher's 30 s delay while
    the one worker runs a blocker: the held batch goes to the device queue
    at once (nothing can join it any more), readiness is false and new
    inference is refused 503 while the drain waits; once the blocker is
    cancelled the held request is answered, long before its delay, exit 0."""
    with moed(tmp, "--model-repository", bigset_repo(os.path.join(tmp, "drain")), "--workers", "1",
              "--max-queue-delay-us", "30000000",
              exit_check=None) as (p, port, http_port):
        busy = blocker(call_fn(channel(port)), http_port)
        h = th.InferenceServerClient(f"127.0.0.1:{p.rest_port}")
        a = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
        ii = th.InferInput("x", [4, 64], "FP32")
        ii.set_data_from_numpy(a)
        fut = h.async_infer("quant.mx", [ii], parameters={"format": "mxfp4"})
        wait_metric(http_port, "moed_batcher_requests ", 1, "draining: the request held by the batcher's delay")
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        wait_metric(http_port, "moed_ready ", 0, "draining: not ready")
        wait_metric(http_port, "moed_batcher_requests ", 0, "draining: the held batch left the batcher at the signal")
        wait_metric(http_port, "moed_device_queue_jobs{", 1, "... for the device queue, behind the blocker")
        ready, _, _ = raw(p.rest_port, "GET", "/v2/health/ready")
        body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]})
        status, msg = error_of(p.rest_port, "POST", "/v2/models/quant.per_tensor/infer", body.encode())
        check(ready == 400 and status == 503 and "shutting down" in msg,
              f"draining: not ready, new inference 503 ({ready}, {status} {msg})")
        busy.cancel()
        r = fut.get_result()
        t = time.monotonic() - t0
        check(r.as_numpy("q").shape == (4, 32) and t < 10,
              f"draining: the held request answered once the worker is free, not at its 30 s delay ({t:.2f}s)")
        check(p.wait(timeout=30) == 0, "draining: exit 0")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        repo = os.path.join(tmp, "repo")
        mkset(f"{repo}/bf16set", "bf16")
        mkset(f"{repo}/fp16set", "fp16")
        with moed(tmp, "--model-repository", repo, "--max-message-bytes", str(16 << 20),
                  "--handshake-timeout", "1") as (p, gport, side):
            URL[0] = f"127.0.0.1:{p.rest_port}"
            h = th.InferenceServerClient(URL[0])
            g = tc.InferenceServerClient(f"127.0.0.1:{gport}")
            test_server(h, g)
            test_models(h, g, p.rest_port)
            test_repository(h, g)
            test_infer(h, g)
            test_nonfinite_json(h, g, p.rest_port)
            test_errors(p.rest_port)
            test_limits(p.rest_port, side)
            status, _, _ = raw(side, "GET", "/v2/health/ready")
            check(status == 200, "the side port's probes still answer")
        test_drain(tmp)
        print_log_tail(tmp)
    exit_with_summary()


if __name__ == "__main__":
    main()
