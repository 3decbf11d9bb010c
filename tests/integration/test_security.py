"""Integration test: names, messages and addresses (issue 13).

- Names: a model, input or output name outside the documented rule
  (letters, digits, '.', '_', '-'; 1-127; not starting with '.') is
  INVALID_ARGUMENT naming the field and never echoed; a NUL inside a name
  field is refused (protobuf-c would cut 'quant.per_token\\0x' to a name
  that exists and serve it).
- Messages: load and upload failures name paths relative to the model
  repository (no server path); a config.json that is some other JSON file
  does not have its keys echoed.
- Addresses: --address takes IPv6 literals with and without brackets; a bad
  address or a port in use stops moed with a non-zero exit and a message.
- TLS on the gRPC port, with certificates made here by the openssl CLI:
  a plaintext client is refused; under --tls-client-auth require a client
  without a certificate, or with one from another CA, is refused, one with
  a certificate from --tls-client-ca is served (optional: also one without);
  SIGHUP makes new connections use rewritten certificate files, and files
  that do not load keep the previous certificate; the HTTP probes check the
  TLS listener without a failed handshake in the log; moec's --tls-* flags.
- TLS on the HTTP ports with the same files: the REST port serves
  tritonclient.http with ssl=True (an inference, bit-identical to the
  plaintext answer's checks) and refuses a plaintext client; the metrics
  port speaks TLS too unless --http-port-plaintext; SIGHUP swaps the REST
  port's certificate like gRPC's; under mTLS a client without a
  certificate, or with one from another CA, is refused, one from
  --tls-client-ca served.
- Tokens (--auth-tokens): no or an unknown token is UNAUTHENTICATED, an
  infer token on a repository change PERMISSION_DENIED, an admin token may
  change it and the log names who did; --auth-health-exempt; SIGHUP rereads
  the file (a bad one keeps the tokens in force); moec --token-file.
- Uploads: --max-uploads and --upload-budget-bytes refuse with
  RESOURCE_EXHAUSTED while others are in progress; a second upload of a
  name being uploaded is ABORTED (never INTERNAL); a chunk whose offset is
  not where the tensor stands is INVALID_ARGUMENT, a tensor whose bytes do
  not match the client's XXH3 DATA_LOSS, and neither set is stored; moec
  sends both and its upload is served.

env: MOED, MOE_MKSET."""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import http.client
import ssl
import threading
import time
import urllib.request

import grpc
import numpy as np
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2 as pb

sys.path.insert(0, os.path.dirname(__file__))
from moed_process import MOED, check, moed, run_tests  # noqa: E402
import test_server as ts  # noqa: E402
from test_server import code_of, make_req, infer_pb, raw_unary  # noqa: E402
from test_fused_moe import mkset, upload_msgs  # noqa: E402

MOEC = os.environ["MOEC"]
SC = grpc.StatusCode
X = np.zeros((4, 64), np.float32).tobytes()


def quant_req(model="quant.per_token", in_name="x", out_name=None):
    r = make_req(model, [(in_name, "FP32", [4, 64], X)], {"out_dtype": "int8"})
    if out_name is not None:
        r.outputs.add().name = out_name
    return r


def test_names(tmp):
    with moed(tmp) as (_, port, _):
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        check(code_of(lambda: infer_pb(ch, quant_req()))[0] == SC.OK, "a valid request is served")
        check(code_of(lambda: infer_pb(ch, quant_req(out_name="q")))[0] == SC.OK, "a valid output name is served")
        # the NUL: protobuf-c would cut the name at it and serve quant.per_token
        for field, req in (("model_name", quant_req(model="quant.per_token\0evil")),
                           ("inputs[0].name", quant_req(in_name="x\0y")),
                           ("outputs[0].name", quant_req(out_name="q\0z"))):
            code, msg = code_of(lambda: infer_pb(ch, req))
            check(code == SC.INVALID_ARGUMENT and msg.startswith(field) and "NUL" in msg,
                  f"NUL in {field}: INVALID_ARGUMENT naming it ({code.name}: {msg})")
        for bad in ('quant"x', "quant\nmoed_requests_total 1", "../etc", "a/b", ".x", "x" * 128, ""):
            for field, req in (("model_name", quant_req(model=bad)), ("inputs[0].name", quant_req(in_name=bad)),
                               ("outputs[0].name", quant_req(out_name=bad))):
                code, msg = code_of(lambda: infer_pb(ch, req))
                check(code == SC.INVALID_ARGUMENT and msg.startswith(field) and (not bad or bad not in msg),
                      f"{field} {bad[:16]!r}: INVALID_ARGUMENT naming the field, not echoing it ({msg})")
        meta = raw_unary(ch, "/inference.GRPCInferenceService/ModelMetadata")
        stats = raw_unary(ch, "/inference.GRPCInferenceService/ModelStatistics")
        for what, fn in (("ModelMetadata", lambda: meta(pb.ModelMetadataRequest(name='a"\nb').SerializeToString())),
                         ("ModelStatistics", lambda: stats(pb.ModelStatisticsRequest(name='a"\nb').SerializeToString()))):
            code, msg = code_of(fn)
            check(code == SC.INVALID_ARGUMENT and msg.startswith("name") and '"' not in msg,
                  f"{what} with a quote and a newline: INVALID_ARGUMENT, not echoed ({msg})")
        # a stream refusal carries the same message
        q = [quant_req(model="a\nb")]
        stream = ch.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                  request_serializer=lambda m: m.SerializeToString(),
                                  response_deserializer=pb.ModelStreamInferResponse.FromString)
        answers = list(stream(iter(q), timeout=30))
        check(len(answers) == 1 and answers[0].error_message.startswith("model_name"),
              f"stream: a bad name answered with an error naming model_name ({answers})")


def test_paths(tmp):
    repo = os.path.join(tmp, "repo")
    os.makedirs(repo, exist_ok=True)
    mkset(os.path.join(repo, "good"), "bf16")
    # a set whose config.json links to some other JSON file
    foreign = os.path.join(tmp, "secrets.json")
    with open(foreign, "w") as f:
        f.write('{"db_password_key": "hunter2", "num_experts": 8}')
    os.makedirs(os.path.join(repo, "linked"))
    os.symlink(foreign, os.path.join(repo, "linked", "config.json"))
    # a set with a truncated weights file
    mkset(os.path.join(repo, "cut"), "bf16")
    wf = [f for f in os.listdir(os.path.join(repo, "cut")) if f.endswith(".safetensors")][0]
    os.truncate(os.path.join(repo, "cut", wf), 100)
    with moed(tmp, "--model-repository", repo) as (_, port, _):
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        load = raw_unary(ch, "/inference.GRPCInferenceService/RepositoryModelLoad")
        for name, want_in_msg in (("linked", "linked/config.json"), ("cut", f"cut/{wf}")):
            code, msg = code_of(lambda: load(pb.RepositoryModelLoadRequest(model_name=name).SerializeToString()))
            check(code != SC.OK and want_in_msg in msg and tmp not in msg and "repo/" not in msg,
                  f"load {name}: fails naming {want_in_msg}, no server path ({code.name}: {msg})")
            if name == "linked":
                check("db_password" not in msg and "hunter2" not in msg,
                      f"a foreign config.json's content is not echoed ({msg})")
        # an upload that fails its set check: named 'upload', not the upload directory
        cfg = '{"num_experts": 8, "hidden_size": 128, "intermediate_size": 64}'
        up = ch.stream_unary("/moe.v1.ExpertStore/Upload", request_serializer=lambda b: b,
                             response_deserializer=lambda b: b)
        msgs = upload_msgs(("newset", cfg, False), [("w2", "bf16", [8, 128, 64], 8 * 128 * 64 * 2,
                                                     bytes(8 * 128 * 64 * 2))])
        code, msg = code_of(lambda: up(iter(msgs), timeout=30))
        check(code == SC.INVALID_ARGUMENT and "upload" in msg and tmp not in msg and ".upload-" not in msg,
              f"a failed upload names no server path ({code.name}: {msg})")


def test_nul_everywhere(tmp):
    """A NUL inside any string of any request is refused naming the field,
    on every gRPC method, an upload and the REST port (protobuf-c and cJSON
    keep C strings: 'good\\0x' would name set 'good', 'out_dtype\\0x' the
    parameter out_dtype); ModelReady refuses a name outside the rule like
    the other calls; a load or unload parameter moed does not take is refused
    on gRPC as on REST; REST paths are percent-decoded (tritonclient.http
    quotes model names), and a decoded name is checked as on gRPC."""
    repo = os.path.join(tmp, "nulrepo")
    mkset(os.path.join(repo, "good"), "bf16")
    with moed(tmp, "--model-repository", repo) as (p, port, _):
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        S = "/inference.GRPCInferenceService/"
        for method, msg, field in (
                ("ModelMetadata", pb.ModelMetadataRequest(name="quant.per_token\0x"), "name"),
                ("ModelReady", pb.ModelReadyRequest(name="quant.per_token\0x"), "name"),
                ("ModelConfig", pb.ModelConfigRequest(name="good\0x"), "name"),
                ("ModelStatistics", pb.ModelStatisticsRequest(name="good\0x"), "name"),
                ("RepositoryModelLoad", pb.RepositoryModelLoadRequest(model_name="good\0x"), "model_name"),
                ("RepositoryModelUnload", pb.RepositoryModelUnloadRequest(model_name="good\0x"), "model_name"),
                ("SystemSharedMemoryRegister",
                 pb.SystemSharedMemoryRegisterRequest(name="r", key="/k\0x", byte_size=8), "key"),
                ("SystemSharedMemoryUnregister", pb.SystemSharedMemoryUnregisterRequest(name="r\0x"), "name")):
            code, m = code_of(lambda: raw_unary(ch, S + method)(msg.SerializeToString(), timeout=30))
            check(code == SC.INVALID_ARGUMENT and m == f"{field}: contains a NUL byte",
                  f"{method}: a NUL in {field} refused naming it ({code.name}: {m})")
        check(ts.tc.InferenceServerClient(f"127.0.0.1:{port}").is_model_ready("good"),
              "the unload of 'good\\0x' left 'good' loaded")
        for params, field in (({"out_dtype\0x": "int8"}, "parameters[0].key"),
                              ({"out_dtype": "int8\0x"}, "parameters[0].value.string_param")):
            r = make_req("quant.per_token", [("x", "FP32", [4, 64], X)], params)
            code, m = code_of(lambda: infer_pb(ch, r))
            check(code == SC.INVALID_ARGUMENT and m == f"{field}: contains a NUL byte",
                  f"ModelInfer: a NUL in {field} refused naming it ({code.name}: {m})")
        # on a stream the refusal carries the request's id, read from the bytes
        # protobuf-c did not decode (none when the id itself holds the NUL)
        reqs = []
        for rid, params in (("a", {"out_dtype\0x": "int8"}), ("b", {"out_dtype": "int8"}), ("c\0d", {"out_dtype": "int8"})):
            reqs.append(make_req("quant.per_token", [("x", "FP32", [4, 64], X)], params))
            reqs[-1].id = rid
        stream = ch.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                  request_serializer=lambda m: m.SerializeToString(),
                                  response_deserializer=pb.ModelStreamInferResponse.FromString)
        got = sorted((a.infer_response.id, a.error_message) for a in stream(iter(reqs), timeout=30))
        check(got == [("", "id: contains a NUL byte"), ("a", "parameters[0].key: contains a NUL byte"), ("b", "")],
              f"stream: NUL refusals carry the request id where it has none itself ({got})")
        up = ch.stream_unary("/moe.v1.ExpertStore/Upload", request_serializer=lambda b: b,
                             response_deserializer=lambda b: b)
        code, m = code_of(lambda: up(iter(upload_msgs(("good\0x", "{}", True))), timeout=30))
        check(code == SC.INVALID_ARGUMENT and m == "header.name: contains a NUL byte",
              f"Upload: a NUL in the set's name refused naming it ({code.name}: {m})")
        code, m = code_of(lambda: raw_unary(ch, S + "ModelReady")(
            pb.ModelReadyRequest(name='a"\nb').SerializeToString(), timeout=30))
        check(code == SC.INVALID_ARGUMENT and m.startswith("name: not a valid model name"),
              f"ModelReady: a name outside the rule is INVALID_ARGUMENT, not ready=false ({code.name}: {m})")
        for method, msg in (("RepositoryModelLoad", pb.RepositoryModelLoadRequest(model_name="good")),
                            ("RepositoryModelUnload", pb.RepositoryModelUnloadRequest(model_name="good"))):
            msg.parameters["bogus"].bool_param = True
            code, m = code_of(lambda: raw_unary(ch, S + method)(msg.SerializeToString(), timeout=30))
            check(code == SC.INVALID_ARGUMENT and m.startswith("parameters.bogus: not supported"),
                  f"{method}: an unknown parameter refused naming it ({code.name}: {m})")
        u = pb.RepositoryModelUnloadRequest(model_name="good")
        u.parameters["unload_dependents"].bool_param = False
        check(code_of(lambda: raw_unary(ch, S + "RepositoryModelUnload")(u.SerializeToString()))[0] == SC.OK,
              "RepositoryModelUnload takes unload_dependents (tritonclient sends it)")
        check(code_of(lambda: raw_unary(ch, S + "RepositoryModelLoad")(
            pb.RepositoryModelLoadRequest(model_name="good").SerializeToString()))[0] == SC.OK, "good reloaded")

        rest = p.rest_port
        body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [4, 64], "data": [0.0] * 256}],
                           "parameters": {"out_dtype": "int8"}})
        check(http_call(rest, "POST", "/v2/models/quant.per_token/infer", body=body.encode())[0] == 200,
              "REST: the plain request is served")
        for what, bad in (("id", body.replace('{"inputs"', '{"id": "a\\u0000b", "inputs"')),
                          ("an input name", body.replace('"x"', '"x\\u0000y"')),
                          ("a parameter key", body.replace('"out_dtype"', '"out_dtype\\u0000x"')),
                          ("a parameter value", body.replace('"int8"', '"int8\\u0000x"'))):
            st, b = http_call(rest, "POST", "/v2/models/quant.per_token/infer", body=bad.encode())
            check(st == 400 and b"a NUL in a JSON string" in b, f"REST infer: a NUL in {what} refused ({st} {b[:120]})")
        st, b = http_call(rest, "POST", "/v2/systemsharedmemory/region/r/register",
                          body=b'{"key": "/k\\u0000x", "byte_size": 8}')
        check(st == 400 and b"a NUL in a JSON string" in b, f"REST shm register: a NUL in the key refused ({st} {b})")
        # percent-encoded paths: decoded, then checked as on gRPC
        for path, want in (("/v2/models/quant%2Eper_token/ready", 200), ("/v2/models/quant.per%5Ftoken", 200),
                           ("/v2/repository/models/go%6Fd/load", 200)):
            st, b = http_call(rest, "POST" if "repository" in path else "GET", path, body=b"{}" if "repository" in path else None)
            check(st == want, f"REST {path}: decoded and served ({st} {b[:100]})")
        for path, want in (("/v2/models/a%22b%0Ac/ready", b"name: not a valid model name"),
                           ("/v2/models/..%2Fgood/ready", b"name: not a valid model name"),
                           ("/v2/models/good%00x/ready", b"path: segment 3: %00 (NUL)"),
                           ("/v2/models/good%2/ready", b"path: segment 3: '%' not followed by two hex digits"),
                           ("/v2/repository/models/good%00x/unload", b"path: segment 4: %00 (NUL)")):
            st, b = http_call(rest, "POST" if "repository" in path else "GET", path, body=b"{}" if "repository" in path else None)
            check(st == 400 and want in b and b'"b' not in b, f"REST {path}: 400 naming what is wrong ({st} {b[:120]})")
        check(ts.tc.InferenceServerClient(f"127.0.0.1:{port}").is_model_ready("good"), "good still loaded")
        # a version is quoted only when it is a number: no quote or newline into the client's log
        bad_v = '1"\nmoed_fake 1'
        code, m = code_of(lambda: raw_unary(ch, S + "ModelMetadata")(
            pb.ModelMetadataRequest(name="good", version=bad_v).SerializeToString(), timeout=30))
        check(code == SC.NOT_FOUND and "has no version '(not a version number)'" in m,
              f"ModelMetadata with a version that is not a number: NOT_FOUND, not echoed ({code.name}: {m})")
        code, m = code_of(lambda: raw_unary(ch, S + "ModelMetadata")(
            pb.ModelMetadataRequest(name="good", version="7").SerializeToString(), timeout=30))
        check(code == SC.NOT_FOUND and "has no version '7'" in m, f"a numeric version is named ({m})")
        r = make_req("quant.per_token", [("x", "FP32", [4, 64], X)], {"out_dtype": "int8"})
        r.model_version = bad_v
        code, m = code_of(lambda: infer_pb(ch, r))
        check(code == SC.NOT_FOUND and m.endswith("has no version '(not a version number)'"),
              f"ModelInfer with a version that is not a number: not echoed ({code.name}: {m})")
        st, b = http_call(rest, "GET", "/v2/models/good/versions/1%22%0Ax/ready")
        check(st == 400 and b"(not a version number)" in b and b"\\n" not in b,
              f"REST ready with a version that is not a number: not echoed ({st} {b})")


def free_port():
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        return s.getsockname()[1]


def test_addresses(tmp):
    for addr in ("::1", "[::1]"):
        with moed(tmp, "--address", addr) as (_, port, http_port):
            live = raw_unary(grpc.insecure_channel(f"[::1]:{port}"), "/inference.GRPCInferenceService/ServerLive")
            check(live(b"", timeout=10) == b"\x08\x01", f"--address {addr}: gRPC served on [::1]")
            with urllib.request.urlopen(f"http://[::1]:{http_port}/v2/health/ready", timeout=10) as r:
                check(r.status == 200, f"--address {addr}: HTTP ready on [::1] (the probe reaches gRPC on ::1)")
    for bad in ("not-an-address", "[::1", "1.2.3.4.5", "[]"):
        r = subprocess.run([MOED, "--address", bad, "--grpc-port", "0", "--http-port", "-1"],
                           capture_output=True, text=True, timeout=30)
        check(r.returncode == 2 and "--address" in r.stderr, f"--address {bad!r}: exit 2 naming the flag ({r.returncode}: {r.stderr.strip()})")
    # a port in use: gRPC's, then the HTTP port's
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        s.listen()
        used = s.getsockname()[1]
        for flags, what in ((["--grpc-port", str(used), "--http-port", "-1"], "gRPC"),
                            (["--grpc-port", "0", "--http-port", str(used)], "HTTP")):
            r = subprocess.run([MOED, "--address", "::1", *flags], capture_output=True, text=True, timeout=30)
            check(r.returncode != 0 and "bind_failed" in r.stderr,
                  f"{what} port in use: non-zero exit with a message ({r.returncode}: {r.stderr.strip()[-200:]})")


def make_certs(d):
    """Two CAs; a server certificate (127.0.0.1, ::1, localhost) from each, a client certificate from each."""
    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    def key_req(name):
        run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", f"{name}.key",
            "-out", f"{name}.csr", "-subj", f"/CN={name}")

    def sign(name, ca, ext):
        with open(os.path.join(d, f"{name}.ext"), "w") as f:
            f.write(ext)
        run("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")
    for ca in ("ca1", "ca2"):
        run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout",
            f"{ca}.key", "-out", f"{ca}.pem", "-days", "2", "-subj", f"/CN=test {ca}")
        key_req(f"server-{ca}")
        sign(f"server-{ca}", ca, "extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,IP:::1,DNS:localhost\n")
        key_req(f"client-{ca}")
        sign(f"client-{ca}", ca, "extendedKeyUsage=clientAuth\n")
    return lambda name: os.path.join(d, name)


def tls_live(port, ca=None, client=None, pem=None):
    """ServerLive over a fresh TLS connection (ca: PEM file of roots; client: name of a client cert/key
    pair) or plaintext (ca None): the status code."""
    opts = [("grpc.use_local_subchannel_pool", 1)]  # a new connection, not one shared with an earlier channel
    target = f"127.0.0.1:{port}"
    if ca is None:
        ch = grpc.insecure_channel(target, options=opts)
    else:
        key = open(pem(f"{client}.key"), "rb").read() if client else None
        cert = open(pem(f"{client}.pem"), "rb").read() if client else None
        ch = grpc.secure_channel(target, grpc.ssl_channel_credentials(open(pem(ca), "rb").read(), key, cert),
                                 options=opts)
    with ch:
        return code_of(lambda: raw_unary(ch, "/inference.GRPCInferenceService/ServerLive")(b"", timeout=5))[0]


def https_get(port, path, ca, client=None, pem=None, method="GET", body=None):
    """GET (or method) over a fresh TLS connection verifying the server against ca (client: name of a
    client certificate to present): the status, or the name of the exception that ended the call."""
    ctx = ssl.create_default_context(cafile=pem(ca))
    if client:
        ctx.load_cert_chain(pem(f"{client}.pem"), pem(f"{client}.key"))
    c = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=10)
    try:
        c.request(method, path, body=body)
        return c.getresponse().status
    except (OSError, http.client.HTTPException) as e:
        return type(e).__name__
    finally:
        c.close()


def plain_get(port, path):
    """GET in plaintext: the status, or the name of the exception."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request("GET", path)
        return c.getresponse().status
    except (OSError, http.client.HTTPException) as e:
        return type(e).__name__
    finally:
        c.close()


def rest_tls_infer(port, pem, client=None):
    """quant.per_token through tritonclient.http over TLS: ready, its q output, the oracle's q."""
    opts = {"ca_certs": pem("ca1.pem")}
    if client:
        opts.update(certfile=pem(f"{client}.pem"), keyfile=pem(f"{client}.key"))
    cli = httpclient.InferenceServerClient(f"127.0.0.1:{port}", ssl=True, ssl_options=opts)
    try:
        x = np.arange(256, dtype=np.float32).reshape(4, 64) - 128
        inp = httpclient.InferInput("x", [4, 64], "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        r = cli.infer("quant.per_token", [inp], parameters={"out_dtype": "int8"})
        ref = ts.moelib.run("quant.per_token", {"x": (x, "fp32")}, {"out_dtype": "int8"})["q"][0]
        return cli.is_server_ready(), r.as_numpy("q"), ref
    finally:
        cli.close()


def test_tls(tmp):
    d = os.path.join(tmp, "pki")
    os.makedirs(d, exist_ok=True)
    pem = make_certs(d)
    served = os.path.join(tmp, "served")  # the files moed is given: rewritten for the reload
    os.makedirs(served, exist_ok=True)
    cert, key = os.path.join(served, "tls.crt"), os.path.join(served, "tls.key")
    shutil.copy(pem("server-ca1.pem"), cert)
    shutil.copy(pem("server-ca1.key"), key)
    log = os.path.join(tmp, "moed.log")

    # server authentication only
    log_at = os.path.getsize(log)
    with moed(tmp, "--tls-cert", cert, "--tls-key", key) as (p, port, http_port):
        for probe in ("live", "ready"):
            check(https_get(http_port, f"/v2/health/{probe}", "ca1.pem", pem=pem) == 200,
                  f"TLS: /v2/health/{probe} 200 over TLS (the probe reaches the TLS listener)")
        time.sleep(0.2)
        with open(log, errors="replace") as f:
            text = f.read()[log_at:]
        check("Handshake failed" not in text, "TLS: the probes cause no failed handshake in the log")
        check(tls_live(port, "ca1.pem", pem=pem) == SC.OK, "TLS: a client trusting ca1 is served")
        check(tls_live(port) == SC.UNAVAILABLE, "TLS: a plaintext client is refused")
        check(tls_live(port, "ca2.pem", pem=pem) == SC.UNAVAILABLE, "TLS: a client trusting another CA refuses the server")
        r = subprocess.run([MOEC, "-a", f"127.0.0.1:{port}", "--tls-ca", pem("ca1.pem"), "health"],
                           capture_output=True, text=True, timeout=60)
        check(r.returncode == 0 and "ready" in r.stdout.lower(), f"moec --tls-ca health ({r.returncode}: {r.stdout.strip()} {r.stderr.strip()[-200:]})")
        r = subprocess.run([MOEC, "-a", f"127.0.0.1:{port}", "--timeout-ms", "3000", "health"],
                           capture_output=True, text=True, timeout=60)
        check(r.returncode != 0, f"moec without TLS fails against the TLS port ({r.returncode})")
        # the HTTP ports: the same certificate
        ready, q, ref = rest_tls_infer(p.rest_port, pem)
        check(ready and q is not None and np.array_equal(q, ref),
              "TLS: tritonclient.http ssl=True is served on the REST port (ready; quant.per_token bit-equal)")
        check(plain_get(p.rest_port, "/v2/health/ready") != 200, "TLS: a plaintext client is refused on the REST port")
        check(plain_get(http_port, "/metrics") != 200, "TLS: ... and on the metrics port")
        check(https_get(p.rest_port, "/v2/health/ready", "ca2.pem", pem=pem) == "SSLCertVerificationError",
              "TLS: a REST client trusting another CA refuses the server")

        # SIGHUP: rewritten files serve new connections; broken ones keep the previous certificate
        shutil.copy(pem("server-ca2.pem"), cert)
        shutil.copy(pem("server-ca2.key"), key)
        check(tls_live(port, "ca1.pem", pem=pem) == SC.OK, "reload: without SIGHUP the old certificate is served")
        p.send_signal(signal.SIGHUP)
        time.sleep(0.3)
        check(tls_live(port, "ca2.pem", pem=pem) == SC.OK, "reload: after SIGHUP a new connection gets the ca2 certificate")
        check(tls_live(port, "ca1.pem", pem=pem) == SC.UNAVAILABLE, "reload: ... and no longer the ca1 one")
        check(https_get(p.rest_port, "/v2/health/live", "ca2.pem", pem=pem) == 200 and
              https_get(p.rest_port, "/v2/health/live", "ca1.pem", pem=pem) == "SSLCertVerificationError",
              "reload: the REST port serves the ca2 certificate after SIGHUP")
        with open(cert, "w") as f:
            f.write("not a certificate\n")
        p.send_signal(signal.SIGHUP)
        time.sleep(0.3)
        check(tls_live(port, "ca2.pem", pem=pem) == SC.OK, "reload: a broken file keeps the previous certificate")
        check(https_get(p.rest_port, "/v2/health/live", "ca2.pem", pem=pem) == 200,
              "reload: ... on the REST port too")
        time.sleep(0.3)
        with open(log, errors="replace") as f:
            text = f.read()[log_at:]
        check("tls_reload_failed" in text, "reload: the broken file is logged")

    # client certificates: required (the default with --tls-client-ca), then optional
    shutil.copy(pem("server-ca1.pem"), cert)
    shutil.copy(pem("server-ca1.key"), key)
    for mode, anonymous in (("require", SC.UNAVAILABLE), ("optional", SC.OK)):
        extra = ["--tls-client-auth", mode] if mode == "optional" else []
        with moed(tmp, "--tls-cert", cert, "--tls-key", key, "--tls-client-ca", pem("ca1.pem"), *extra) as (p, port, _):
            check(tls_live(port, "ca1.pem", "client-ca1", pem) == SC.OK, f"mTLS {mode}: a client certificate from ca1 is served")
            check(tls_live(port, "ca1.pem", pem=pem) == anonymous,
                  f"mTLS {mode}: a client without a certificate -> {anonymous.name}")
            check(tls_live(port, "ca1.pem", "client-ca2", pem) == SC.UNAVAILABLE,
                  f"mTLS {mode}: a client certificate from another CA is refused")
            r = p.rest_port
            check(https_get(r, "/v2/health/ready", "ca1.pem", "client-ca1", pem) == 200,
                  f"mTLS {mode}: REST with a client certificate from ca1 is served")
            got = https_get(r, "/v2/health/ready", "ca1.pem", pem=pem)
            check(got == 200 if mode == "optional" else got != 200,
                  f"mTLS {mode}: REST without a client certificate -> {'served' if mode == 'optional' else 'refused'} ({got})")
            got = https_get(r, "/v2/health/ready", "ca1.pem", "client-ca2", pem)
            check(got != 200, f"mTLS {mode}: REST with a client certificate from another CA is refused ({got})")
            if mode == "require":
                log_at = os.path.getsize(log)
                got = https_get(r, "/v2/repository/models/nosuch/unload", "ca1.pem", "client-ca1", pem, "POST", b"{}")
                time.sleep(0.2)
                with open(log, errors="replace") as f:
                    text = f.read()[log_at:]
                check(got == 404 and re.search(r"repository_unload: nosuch: .*, by rest:127.0.0.1:\d+ cert 'CN=client-ca1'", text),
                      f"mTLS: a REST repository change's log line names the client certificate ({got})")
                ready, q, ref = rest_tls_infer(r, pem, "client-ca1")
                check(ready and q is not None and np.array_equal(q, ref),
                      "mTLS: tritonclient.http with a client certificate infers (bit-equal)")
            if mode == "require":
                r = subprocess.run([MOEC, "-a", f"127.0.0.1:{port}", "--tls-ca", pem("ca1.pem"), "--tls-cert",
                                    pem("client-ca1.pem"), "--tls-key", pem("client-ca1.key"), "health"],
                                   capture_output=True, text=True, timeout=60)
                check(r.returncode == 0, f"moec --tls-cert/--tls-key under mTLS ({r.returncode}: {r.stderr.strip()[-200:]})")

    # --http-port-plaintext: the metrics port stays plain (kubelet's probes under mTLS), REST does not
    with moed(tmp, "--tls-cert", cert, "--tls-key", key, "--tls-client-ca", pem("ca1.pem"),
              "--http-port-plaintext") as (p, port, http_port):
        check(plain_get(http_port, "/v2/health/ready") == 200, "--http-port-plaintext: the probes answer in plaintext")
        check(plain_get(p.rest_port, "/v2/health/ready") != 200, "--http-port-plaintext: the REST port is still TLS")
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        m = re.search(r'^moed_http_connections_closed_total\{port="rest",reason="tls"\} (\d+)$', text, re.M)
        check(m is not None and int(m.group(1)) == 1, f"the plaintext client's failed handshake counted ({m and m.group(0)})")

    # bad TLS command lines stop moed naming the problem
    for args, want in ((["--tls-cert", cert], "--tls-key"),
                       (["--tls-client-ca", pem("ca1.pem")], "--tls-cert"),
                       (["--tls-cert", cert, "--tls-key", key, "--tls-client-auth", "require"], "--tls-client-ca"),
                       (["--tls-cert", cert, "--tls-key", key, "--tls-client-auth", "maybe"], "--tls-client-auth"),
                       (["--tls-cert", os.path.join(tmp, "missing.pem"), "--tls-key", key], "missing.pem")):
        r = subprocess.run([MOED, "--grpc-port", "0", "--http-port", "-1", *args], capture_output=True, text=True,
                           timeout=30)
        check(r.returncode != 0 and want in r.stderr, f"moed {' '.join(a[-12:] for a in args)}: refused naming {want} ({r.returncode}: {r.stderr.strip()[-160:]})")


READER, OPS = "reader-token-0123456789", "admin-token-0123456789abcdef"


def bearer(token):
    return [("authorization", f"Bearer {token}")] if token else None


def http_call(port, method, path, token=None, body=None):
    """One plaintext HTTP request with a bearer token or none: the status and the body."""
    rq = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method=method,
                                headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(rq, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def http_get(port, path, token=None):
    """GET on the metrics/probe port."""
    return http_call(port, "GET", path, token)


def write_tokens(path, lines):
    with open(path, "w") as f:
        f.write("# name role token\n" + "".join(f"{n} {r} {t}\n" for n, r, t in lines))


def test_auth(tmp):
    repo = os.path.join(tmp, "auth-repo")
    os.makedirs(repo, exist_ok=True)
    mkset(os.path.join(repo, "good"), "bf16")
    tokens = os.path.join(tmp, "tokens")
    write_tokens(tokens, [("reader", "infer", READER), ("ops", "admin", OPS)])
    log = os.path.join(tmp, "moed.log")
    log_at = os.path.getsize(log)
    with moed(tmp, "--model-repository", repo, "--auth-tokens", tokens) as (p, port, http_port):
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        live = raw_unary(ch, "/inference.GRPCInferenceService/ServerLive")
        infer = raw_unary(ch, "/inference.GRPCInferenceService/ModelInfer")
        load = raw_unary(ch, "/inference.GRPCInferenceService/RepositoryModelLoad")
        unload = raw_unary(ch, "/inference.GRPCInferenceService/RepositoryModelUnload")
        req = quant_req().SerializeToString()

        def call(fn, payload, token=None, raw_md=None):
            return code_of(lambda: fn(payload, timeout=10, metadata=raw_md or bearer(token)))
        for what, md in (("no token", None), ("an unknown token", bearer("x" * 20)),
                         ("not a bearer token", [("authorization", f"Basic {READER}")])):
            for name, fn, payload in (("ServerLive", live, b""), ("ModelInfer", infer, req),
                                      ("RepositoryModelLoad", load, pb.RepositoryModelLoadRequest(model_name="good").SerializeToString())):
                code, msg = call(fn, payload, raw_md=md)
                check(code == SC.UNAUTHENTICATED and msg.startswith("authorization"),
                      f"{name} with {what}: UNAUTHENTICATED ({code.name}: {msg})")
        check(call(live, b"", READER)[0] == SC.OK and call(infer, req, READER)[0] == SC.OK,
              "an infer token: ServerLive and ModelInfer served")
        unload_good = pb.RepositoryModelUnloadRequest(model_name="good").SerializeToString()
        load_good = pb.RepositoryModelLoadRequest(model_name="good").SerializeToString()
        for name, fn, payload in (("RepositoryModelUnload", unload, unload_good), ("RepositoryModelLoad", load, load_good)):
            code, msg = call(fn, payload, READER)
            check(code == SC.PERMISSION_DENIED and "reader" in msg and READER not in msg,
                  f"{name} with an infer token: PERMISSION_DENIED naming the token, not showing it ({msg})")
        up = ch.stream_unary("/moe.v1.ExpertStore/Upload", request_serializer=lambda b: b, response_deserializer=lambda b: b)
        code, _ = code_of(lambda: up(iter(upload_msgs(("x", "{}", False))), timeout=10, metadata=bearer(READER)))
        check(code == SC.PERMISSION_DENIED, f"Upload with an infer token: PERMISSION_DENIED ({code.name})")
        check(call(unload, unload_good, OPS)[0] == SC.OK and call(load, load_good, OPS)[0] == SC.OK,
              "an admin token unloads and loads")
        # the REST port takes the same tokens and roles from the Authorization header
        def rest(method, path, token=None, body=None):
            return http_call(p.rest_port, method, path, token, body)
        check(rest("GET", "/v2/models/good")[0] == 401, "REST without a token: 401")
        check(rest("GET", "/v2/models/good", "x" * 20)[0] == 401, "REST with an unknown token: 401")
        check(rest("GET", "/v2/models/good", READER)[0] == 200, "REST metadata with an infer token: 200")
        code, body = rest("POST", "/v2/repository/models/good/unload", READER, b"{}")
        check(code == 403 and b"reader" in body and READER.encode() not in body,
              f"REST unload with an infer token: 403 naming the token, not showing it ({code} {body[:120]})")
        check(rest("POST", "/v2/repository/models/good/unload", OPS, b"{}")[0] == 200 and
              rest("POST", "/v2/repository/models/good/load", OPS, b"{}")[0] == 200,
              "REST: an admin token unloads and loads")
        # the token is checked before a body is read or parsed: a client without
        # one cannot make moed buffer --max-message-bytes per connection, and a
        # refusal is 401/403 whatever the body (it was 400/413 after the parse)
        for what, token in (("no token", None), ("an unknown token", "x" * 20)):
            s = socket.create_connection(("127.0.0.1", p.rest_port), timeout=10)
            s.sendall(b"POST /v2/models/quant.per_token/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 104857600\r\n" +
                      (f"Authorization: Bearer {token}\r\n".encode() if token else b"") + b"\r\n")
            try:
                head = s.recv(4096)
            except socket.timeout:
                head = b"(no answer in 10 s: waiting for the 100 MiB body)"
            s.close()
            check(head.startswith(b"HTTP/1.1 401") and b"authorization" in head,
                  f"REST: a body announced with {what} is refused 401 before it is read ({head[:60]})")
        for path, token, body, want in (("/v2/models/quant.per_token/infer", None, b"{}", 401),
                                        ("/v2/models/quant.per_token/infer", "x" * 20, b"[" * 1000, 401),
                                        ("/v2/repository/models/good/load", READER, b"[not json", 403),
                                        ("/v2/repository/models/good/unload", READER, b'{"parameters": 5}', 403),
                                        ("/v2/repository/index", None, b"[not json", 401),
                                        ("/v2/systemsharedmemory/region/r/register", "x" * 20, b"{}", 401)):
            code, b = rest("POST", path, token, body)
            check(code == want and b"authorization" in b, f"REST {path} with a bad body: {want} first ({code} {b[:80]})")
        # the metrics and probe port: the same tokens; /metrics needs an infer token, probes any token
        for path in ("/metrics", "/v2/health/live", "/v2/health/ready"):
            for what, token in (("no token", None), ("an unknown token", "x" * 20)):
                code, body = http_get(http_port, path, token)
                check(code == 401 and body.startswith(b'{"error":"authorization') and b"x" * 20 not in body,
                      f"HTTP port {path} with {what}: 401 naming authorization ({code} {body[:80]})")
            code, body = http_get(http_port, path, READER)
            check(code == 200, f"HTTP port {path} with an infer token: 200 ({code})")
        check(b"moed_requests_total" in http_get(http_port, "/metrics", OPS)[1], "/metrics with an admin token: served")
        # stream: the token is checked when the stream starts
        stream = ch.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                  request_serializer=lambda m: m.SerializeToString(),
                                  response_deserializer=pb.ModelStreamInferResponse.FromString)
        code, _ = code_of(lambda: list(stream(iter([quant_req()]), timeout=10)))
        check(code == SC.UNAUTHENTICATED, f"ModelStreamInfer without a token: UNAUTHENTICATED ({code.name})")
        answers = list(stream(iter([quant_req()]), timeout=10, metadata=bearer(READER)))
        check(len(answers) == 1 and not answers[0].error_message, "ModelStreamInfer with an infer token: served")
        # moec
        tf = os.path.join(tmp, "moec-token")
        with open(tf, "w") as f:
            f.write(READER + "\n")
        r = subprocess.run([MOEC, "-a", f"127.0.0.1:{port}", "--token-file", tf, "health"], capture_output=True,
                           text=True, timeout=60)
        check(r.returncode == 0, f"moec --token-file health ({r.returncode}: {r.stderr.strip()[-200:]})")
        r = subprocess.run([MOEC, "-a", f"127.0.0.1:{port}", "health"], capture_output=True, text=True, timeout=60)
        check(r.returncode != 0 and "UNAUTHENTICATED" in r.stderr, f"moec without a token refused ({r.stderr.strip()[-160:]})")
        # SIGHUP: the file is read again; a broken one keeps the tokens in force
        write_tokens(tokens, [("fresh", "infer", "fresh-token-0123456789"), ("ops", "admin", OPS)])
        p.send_signal(signal.SIGHUP)
        time.sleep(0.3)
        check(call(live, b"", READER)[0] == SC.UNAUTHENTICATED and call(live, b"", "fresh-token-0123456789")[0] == SC.OK,
              "SIGHUP: a removed token is refused, a new one served")
        with open(tokens, "w") as f:
            f.write("broken line\n")
        p.send_signal(signal.SIGHUP)
        time.sleep(0.3)
        check(call(live, b"", "fresh-token-0123456789")[0] == SC.OK, "SIGHUP with a broken file keeps the tokens in force")
        with open(log, errors="replace") as f:
            text = f.read()[log_at:]
        who = re.search(r"repository_unload: good: done, by (\S+) token 'ops'", text)
        check(who is not None and who.group(1).startswith("ipv4:127.0.0.1:"),
              "the unload's log line names the peer's address and token")
        check(re.search(r"auth_refused: /inference.GRPCInferenceService/RepositoryModelLoad from ipv4:127.0.0.1:\d+ token 'reader'", text),
              "a refused repository change is logged with who tried")
        check(re.search(r"repository_unload: good: done, by rest:127.0.0.1:\d+ token 'ops'", text),
              "a REST unload's log line names the peer's address and token")
        check(re.search(r"auth_refused: REST /inference.GRPCInferenceService/RepositoryModelUnload from "
                        r"rest:127.0.0.1:\d+ token 'reader'", text), "a refused REST change is logged with who tried")
        check("auth_reload_failed" in text, "the broken token file is logged")
        check(READER not in text and OPS not in text, "no token appears in the log")
    # health exempt
    write_tokens(tokens, [("reader", "infer", READER)])
    with moed(tmp, "--auth-tokens", tokens, "--auth-health-exempt") as (_, port, http_port):
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        check(code_of(lambda: raw_unary(ch, "/inference.GRPCInferenceService/ServerLive")(b"", timeout=10))[0] == SC.OK,
              "--auth-health-exempt: ServerLive without a token")
        check(code_of(lambda: raw_unary(ch, "/grpc.health.v1.Health/Check")(b"", timeout=10))[0] == SC.OK,
              "--auth-health-exempt: grpc.health.v1 Check without a token")
        check(code_of(lambda: infer_pb(ch, quant_req()))[0] == SC.UNAUTHENTICATED,
              "--auth-health-exempt: ModelInfer still needs one")
        for probe in ("live", "ready"):
            check(http_get(http_port, f"/v2/health/{probe}")[0] == 200,
                  f"--auth-health-exempt: HTTP port /v2/health/{probe} without a token: 200")
        code, body = http_get(http_port, "/metrics")
        check(code == 401 and b"authorization" in body, f"--auth-health-exempt: /metrics still needs a token ({code})")
    # metrics exempt (through the env): Prometheus without a token, the probes still need one
    with moed(tmp, "--auth-tokens", tokens, env={"MOED_AUTH_METRICS_EXEMPT": "1"}) as (_, port, http_port):
        code, body = http_get(http_port, "/metrics")
        check(code == 200 and b"moed_ready 1" in body, f"MOED_AUTH_METRICS_EXEMPT=1: /metrics without a token ({code})")
        check(http_get(http_port, "/v2/health/ready")[0] == 401, "MOED_AUTH_METRICS_EXEMPT=1: probes still need a token")
    # a bad token file stops the start, naming the line, never the token
    for content, want in (("a infer short\n", "tokens:1: TOKEN"), ("a reader 0123456789abcdefgh\n", "tokens:1: ROLE"),
                          ("a/b infer 0123456789abcdefgh\n", "tokens:1: NAME"), ("# nothing\n", "no tokens")):
        with open(tokens, "w") as f:
            f.write(content)
        r = subprocess.run([MOED, "--grpc-port", "0", "--http-port", "-1", "--auth-tokens", tokens],
                           capture_output=True, text=True, timeout=30)
        check(r.returncode != 0 and want in r.stderr and "0123456789abcdefgh" not in r.stderr,
              f"token file {content.strip()!r}: refused naming {want!r} ({r.returncode})")


def test_upload_limits(tmp):
    cfg = '{"num_experts": 8, "hidden_size": 128, "intermediate_size": 64}'
    n = 8 * 128 * 64 * 2

    def held_upload(ch, name, release):
        """An upload that sends its header and one tensor's first chunk, then waits for `release`."""
        msgs = upload_msgs((name, cfg, False), [("w2", "bf16", [8, 64, 128], n, bytes(n))], chunk=4096)

        def gen():
            yield msgs[0]
            yield msgs[1]
            release.wait(30)
        up = ch.stream_unary("/moe.v1.ExpertStore/Upload", request_serializer=lambda b: b, response_deserializer=lambda b: b)
        return up.future(gen(), timeout=60)
    for flags, what, want in ((["--max-uploads", "1"], "a second upload past --max-uploads 1", "--max-uploads"),
                              (["--upload-budget-bytes", str(n + n // 2)], "a second upload past the byte budget",
                               "--upload-budget-bytes")):
        with moed(tmp, *flags) as (_, port, _):
            ch = grpc.insecure_channel(f"127.0.0.1:{port}")
            release = threading.Event()
            first = held_upload(ch, "first", release)
            time.sleep(0.5)
            up = ch.stream_unary("/moe.v1.ExpertStore/Upload", request_serializer=lambda b: b, response_deserializer=lambda b: b)
            msgs = upload_msgs(("second", cfg, False), [("w2", "bf16", [8, 64, 128], n, bytes(n))], chunk=4096)
            code, msg = code_of(lambda: up(iter(msgs), timeout=30))
            check(code == SC.RESOURCE_EXHAUSTED and want in msg, f"{what}: RESOURCE_EXHAUSTED naming {want} ({code.name}: {msg})")
            release.set()
            code, _ = code_of(lambda: first.result())
            check(code != SC.RESOURCE_EXHAUSTED, f"the first upload was not refused ({code.name})")
            # once it ended, another one is admitted (its set check fails: it is incomplete)
            code, msg = code_of(lambda: up(iter(msgs), timeout=30))
            check(code == SC.INVALID_ARGUMENT, f"after it: the next upload is admitted ({code.name}: {msg})")


def varint(n):
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        if not n:
            return out + bytes([b])
        out += bytes([b | 0x80])


def fld(num, data):
    return varint(num << 3 | 2) + varint(len(data)) + data


def vfld(num, n):
    return varint(num << 3) + varint(n)


def tensor_header(name, dtype, shape, nbytes, xxh3=None):
    return fld(1, name.encode()) + fld(2, dtype.encode()) + fld(3, b"".join(varint(d) for d in shape)) + \
        vfld(4, nbytes) + (vfld(5, xxh3) if xxh3 is not None else b"")


def chunk_msg(th, data, offset=None):
    return fld(2, (fld(1, th) if th else b"") + fld(2, data) + (vfld(3, offset) if offset is not None else b""))


def header_msg(name, cfg, replace=False, checks=True):
    """An upload's header; checks: chunk_offsets and tensor_xxh3 set."""
    return fld(1, fld(1, name.encode()) + fld(2, cfg.encode()) + (vfld(3, 1) if replace else b"") +
               (vfld(4, 1) + vfld(5, 1) if checks else b""))


def test_upload_integrity(tmp):
    repo = os.path.join(tmp, "up-repo")
    os.makedirs(repo, exist_ok=True)
    src = os.path.join(tmp, "up-src")
    mkset(src, "bf16")
    cfg = open(os.path.join(src, "config.json")).read()
    with moed(tmp, "--model-repository", repo) as (_, port, _):
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        up = ch.stream_unary("/moe.v1.ExpertStore/Upload", request_serializer=lambda b: b, response_deserializer=lambda b: b)
        ready = raw_unary(ch, "/inference.GRPCInferenceService/ModelReady")

        def is_ready(name):
            return ready(pb.ModelReadyRequest(name=name).SerializeToString(), timeout=10) == b"\x08\x01"
        th = tensor_header("w2", "bf16", [8, 128, 64], 8 * 128 * 64 * 2)
        data = bytes(range(256)) * (8 * 128 * 64 * 2 // 256)
        # without the header's options, offsets are not read (older clients send none)
        msgs = [header_msg("old", cfg, checks=False), chunk_msg(th, data[:4096], 0),
                chunk_msg(None, data[4096:8192], 0)]
        code, msg = code_of(lambda: up(iter(msgs), timeout=30))
        check(code == SC.INVALID_ARGUMENT and "missing" in msg and "offset" not in msg,
              f"without chunk_offsets, offsets are not checked ({msg})")
        # a lost chunk: the next one's offset is not where the tensor stands
        msgs = [header_msg("gap", cfg), chunk_msg(th, data[:4096], 0), chunk_msg(None, data[8192:12288], 8192)]
        code, msg = code_of(lambda: up(iter(msgs), timeout=30))
        check(code == SC.INVALID_ARGUMENT and msg.startswith("chunk.offset") and "4096" in msg,
              f"a chunk at the wrong offset: INVALID_ARGUMENT naming chunk.offset ({code.name}: {msg})")
        # a repeated chunk
        msgs = [header_msg("gap", cfg), chunk_msg(th, data[:4096], 0), chunk_msg(None, data[:4096], 0)]
        code, msg = code_of(lambda: up(iter(msgs), timeout=30))
        check(code == SC.INVALID_ARGUMENT and msg.startswith("chunk.offset"), f"a repeated chunk: INVALID_ARGUMENT ({msg})")
        # bytes that do not match the client's checksum
        th_bad = tensor_header("w2", "bf16", [8, 128, 64], len(data), xxh3=12345)
        msgs = [header_msg("corrupt", cfg)] + [chunk_msg(th_bad if o == 0 else None, data[o:o + 65536], o)
                                               for o in range(0, len(data), 65536)]
        code, msg = code_of(lambda: up(iter(msgs), timeout=30))
        check(code == SC.DATA_LOSS and msg.startswith("chunk.tensor.xxh3") and "0000000000003039" in msg,
              f"a checksum mismatch: DATA_LOSS naming chunk.tensor.xxh3 ({code.name}: {msg})")
        check(not is_ready("corrupt") and not os.path.exists(os.path.join(repo, "corrupt")),
              "the corrupt upload is neither served nor stored")
        # a name the client sent, quoted in the log, cannot forge a log line
        forged = "w99\n2026-01-01T00:00:00.000Z info  model_loaded: forged"
        msgs = [header_msg("forge", cfg), chunk_msg(tensor_header(forged, "bf16", [4], 8), bytes(8), 0)]
        code, msg = code_of(lambda: up(iter(msgs), timeout=30))
        time.sleep(0.2)
        with open(os.path.join(tmp, "moed.log"), errors="replace") as f:
            lines = f.read().splitlines()
        check(code == SC.INVALID_ARGUMENT and not any(l.endswith("model_loaded: forged") for l in lines),
              f"a newline in an uploaded tensor name does not start a log line ({code.name})")
        # the same name twice at once: the second is ABORTED, whatever `replace` says
        for replace in (False, True):
            release = threading.Event()

            def held():
                yield header_msg("twice", cfg, replace)
                yield chunk_msg(th, data[:4096], 0)
                release.wait(30)
            first = up.future(held(), timeout=60)
            time.sleep(0.5)
            code, msg = code_of(lambda: up(iter([header_msg("twice", cfg, replace)]), timeout=30))
            check(code == SC.ABORTED and msg.startswith("header.name"),
                  f"a second upload of a name in progress (replace={replace}): ABORTED ({code.name}: {msg})")
            release.set()
            code_of(lambda: first.result())
        # moec sends offsets and checksums: its upload is served
        r = subprocess.run([MOEC, "-a", f"127.0.0.1:{port}", "upload", src, "--name", "checked"],
                           capture_output=True, text=True, timeout=120)
        check(r.returncode == 0 and is_ready("checked"), f"moec upload with offsets and XXH3 served ({r.returncode}: {r.stderr.strip()[-200:]})")


if __name__ == "__main__":
    run_tests(test_names, test_nul_everywhere, test_paths, test_addresses, test_tls, test_auth, test_upload_limits, test_upload_integrity)
