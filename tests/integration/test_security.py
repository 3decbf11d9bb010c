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

env: MOED, MOE_MKSET."""
import os
import socket
import subprocess
import sys
import urllib.request

import grpc
import numpy as np
from tritonclient.grpc import service_pb2 as pb

sys.path.insert(0, os.path.dirname(__file__))
import test_server as ts  # noqa: E402
from test_server import check, code_of, make_req, infer_pb, raw_unary  # noqa: E402
from test_fused_moe import mkset, upload_msgs  # noqa: E402

MOED = os.environ["MOED"]
SC = grpc.StatusCode
X = np.zeros((4, 64), np.float32).tobytes()


def quant_req(model="quant.per_token", in_name="x", out_name=None):
    r = make_req(model, [(in_name, "FP32", [4, 64], X)], {"out_dtype": "int8"})
    if out_name is not None:
        r.outputs.add().name = out_name
    return r


def test_names(tmp):
    p, port, _ = ts.start(tmp)
    try:
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
    finally:
        ts.stop(p)


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
    p, port, _ = ts.start(tmp, "--model-repository", repo)
    try:
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
    finally:
        ts.stop(p)


def free_port():
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        return s.getsockname()[1]


def test_addresses(tmp):
    for addr in ("::1", "[::1]"):
        p, port, http_port = ts.start(tmp, "--address", addr)
        try:
            live = raw_unary(grpc.insecure_channel(f"[::1]:{port}"), "/inference.GRPCInferenceService/ServerLive")
            check(live(b"", timeout=10) == b"\x08\x01", f"--address {addr}: gRPC served on [::1]")
            with urllib.request.urlopen(f"http://[::1]:{http_port}/v2/health/ready", timeout=10) as r:
                check(r.status == 200, f"--address {addr}: HTTP ready on [::1] (the probe reaches gRPC on ::1)")
        finally:
            ts.stop(p)
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


if __name__ == "__main__":
    ts.run_tests(test_names, test_paths, test_addresses)
