"""Integration test: fused_moe over the wire, ExpertStore upload, batching
and the inline-weight cache, against a real moed on a free loopback port.

Expert sets come from moe-mkset in a temporary model repository; every
result must be bit-equal to libmoe called directly (tests/oracle/moelib.py).

env: MOED, MOEC, MOE_LIB, MOE_MKSET."""
import concurrent.futures as cf
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import grpc
import numpy as np
import tritonclient.grpc as tc

sys.path.insert(0, os.path.dirname(__file__))
from moed_process import MOED, check, exit_with_summary, moed, print_log_tail  # noqa: E402
import test_server as ts  # noqa: E402
from test_server import code_of, infer_pb, make_req  # noqa: E402

moelib = ts.moelib
MOEC, MKSET = os.environ["MOEC"], os.environ["MOE_MKSET"]
SC = grpc.StatusCode


def bf16(a):
    return (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def mkset(path, scheme, experts=8, hidden=128, inter=64, top_k=2, extra=()):
    subprocess.run([MKSET, "--out", path, "--scheme", scheme, "--experts", str(experts), "--hidden", str(hidden),
                    "--intermediate", str(inter), "--top-k", str(top_k), *extra], check=True, capture_output=True)


def read_safetensors(path):
    """{name: (array in storage type, moe dtype name)} of a safetensors file."""
    st = {"BF16": (np.uint16, "bf16"), "F16": (np.uint16, "fp16"), "F32": (np.float32, "fp32"),
          "U8": (np.uint8, "uint8")}
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    hdr = json.loads(raw[8:8 + n])
    out = {}
    for name, d in hdr.items():
        if name == "__metadata__":
            continue
        a, b = d["data_offsets"]
        np_t, moe_t = st[d["dtype"]]
        out[name] = (np.frombuffer(raw[8 + n + a:8 + n + b], np_t).reshape(d["shape"]).copy(), moe_t)
    return out


KS = {"bf16": "BF16", "fp16": "FP16", "fp32": "FP32", "uint8": "UINT8", "int32": "INT32"}


def req_of(model, ins, params=None):
    return make_req(model, [(n, KS[d], list(a.shape), a.tobytes()) for n, (a, d) in ins.items()], params)


def oracle(set_dir, ins, params=None):
    with moelib.ExpertSet(set_dir, "oracle") as s:
        return moelib.run("fused_moe", ins, params or {}, expert_set=s.ptr)["output"][0]


def routed_inputs(rng, tokens, hidden, experts, act="bf16"):
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    xs = bf16(x) if act == "bf16" else x.astype(np.float16).view(np.uint16)
    return {"hidden_states": (xs, act), "router_logits": (rng.standard_normal((tokens, experts)).astype(np.float32),
                                                           "fp32")}


def metric(http_port, name):
    text = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics").read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def test_repository_sets(cli, ch, repo):
    rng = np.random.default_rng(11)
    # bf16 set, router_logits, raw grpc (BF16 travels as raw bytes)
    ins = routed_inputs(rng, 7, 128, 8)
    resp = infer_pb(ch, req_of("bf16set", ins))
    ref = oracle(f"{repo}/bf16set", ins)
    check(resp.raw_output_contents[0] == ref.tobytes() and list(resp.outputs[0].shape) == [7, 128]
          and resp.outputs[0].datatype == "BF16", "fused_moe bf16 set, router_logits: bit-equal")
    # fp16 set through tritonclient, router_logits
    x = rng.standard_normal((5, 128)).astype(np.float16)
    lg = rng.standard_normal((5, 8)).astype(np.float32)
    i0, i1 = tc.InferInput("hidden_states", [5, 128], "FP16"), tc.InferInput("router_logits", [5, 8], "FP32")
    i0.set_data_from_numpy(x)
    i1.set_data_from_numpy(lg)
    r = cli.infer("fp16set", [i0, i1])
    ref = oracle(f"{repo}/fp16set", {"hidden_states": (x.view(np.uint16), "fp16"), "router_logits": (lg, "fp32")})
    check(r.as_numpy("output").view(np.uint16).tobytes() == ref.tobytes(),
          "tritonclient fused_moe fp16 set, router_logits: bit-equal")
    # wna16 set (int4, zero points) through tritonclient, topk ids + weights
    ids = np.stack([rng.permutation(8)[:2] for _ in range(6)]).astype(np.int32)
    w = rng.random((6, 2)).astype(np.float32)
    x = rng.standard_normal((6, 128)).astype(np.float16)
    ii = [tc.InferInput("hidden_states", [6, 128], "FP16"), tc.InferInput("topk_ids", [6, 2], "INT32"),
          tc.InferInput("topk_weights", [6, 2], "FP32")]
    for inp, a in zip(ii, (x, ids, w)):
        inp.set_data_from_numpy(a)
    r = cli.infer("wnaset", ii)
    ref = oracle(f"{repo}/wnaset", {"hidden_states": (x.view(np.uint16), "fp16"), "topk_ids": (ids, "int32"),
                                    "topk_weights": (w, "fp32")})
    check(r.as_numpy("output").view(np.uint16).tobytes() == ref.tobytes(),
          "tritonclient fused_moe wna16 set, topk_ids/topk_weights: bit-equal")
    # a set's config shows in ModelConfig; weight inputs are hidden
    c = cli.get_model_config("wnaset").config
    check("expert_set_config" in c.parameters and not any(i.name.startswith("w13") for i in c.input),
          "ModelConfig of an expert set")
    code, msg = code_of(lambda: infer_pb(ch, req_of("bf16set", dict(routed_inputs(rng, 2, 64, 8)))))
    check(code == SC.INVALID_ARGUMENT and "hidden_states" in msg, f"fused_moe wrong hidden size ({msg})")


def test_inline(ch, repo, http_port):
    rng = np.random.default_rng(12)
    wts = read_safetensors(f"{repo}/bf16set/weights.safetensors")
    ins = routed_inputs(rng, 4, 128, 8)
    ins.update({"w13": wts["w13"], "w2": wts["w2"]})
    ref = moelib.run("fused_moe", ins, {"top_k": 2})["output"][0]
    hits0 = metric(http_port, "moed_weight_cache_hits_total") or 0
    outs = [infer_pb(ch, req_of("fused_moe", ins, {"top_k": 2})).raw_output_contents[0] for _ in range(3)]
    check(all(o == ref.tobytes() for o in outs), "built-in fused_moe, inline bf16 weights: bit-equal (3 calls)")
    hits = metric(http_port, "moed_weight_cache_hits_total") or 0
    check(hits - hits0 >= 2, f"inline weights cached: {hits - hits0} hits for 3 identical calls")
    code, msg = code_of(lambda: infer_pb(ch, req_of("fused_moe", {k: ins[k] for k in ("hidden_states", "router_logits", "w13", "w2")})))
    check(code == SC.INVALID_ARGUMENT and "top_k" in msg, f"inline weights without top_k ({msg})")
    # wna16 inline, topk ids
    q = read_safetensors(f"{repo}/wnaset/weights.safetensors")
    ids = np.stack([rng.permutation(8)[:2] for _ in range(3)]).astype(np.int32)
    x = rng.standard_normal((3, 128)).astype(np.float16).view(np.uint16)
    ins = {"hidden_states": (x, "fp16"), "topk_ids": (ids, "int32"),
           "topk_weights": (rng.random((3, 2)).astype(np.float32), "fp32"), **q}
    ref = moelib.run("fused_moe", ins, {})["output"][0]
    got = infer_pb(ch, req_of("fused_moe", ins)).raw_output_contents[0]
    check(got == ref.tobytes(), "built-in fused_moe, inline wna16 weights + topk ids: bit-equal")


def test_batching(ch, repo):
    rng = np.random.default_rng(13)
    pool = cf.ThreadPoolExecutor(32)
    cases = [routed_inputs(rng, 1 + k % 4, 128, 8) for k in range(24)]
    futs = [pool.submit(infer_pb, ch, req_of("bf16set", c)) for c in cases]
    got = [f.result().raw_output_contents[0] for f in futs]
    ok = all(g == oracle(f"{repo}/bf16set", c).tobytes() for g, c in zip(got, cases))
    check(ok, "24 concurrent fused_moe requests: each bit-equal to the library run alone")
    xs = [rng.standard_normal((1 + k % 3, 64)).astype(np.float32) for k in range(24)]
    futs = [pool.submit(infer_pb, ch, req_of("quant.mx", {"x": (x, "fp32")}, {"format": "mxfp4"})) for x in xs]
    ok = True
    for f, x in zip(futs, xs):
        r = f.result()
        ref = moelib.run("quant.mx", {"x": (x, "fp32")}, {"format": "mxfp4"})
        ok = ok and r.raw_output_contents[0] == ref["q"][0].tobytes() and r.raw_output_contents[1] == ref["scales"][0].tobytes()
    check(ok, "24 concurrent quant.mx requests: each bit-equal to the library run alone")
    # different parameters never merge: each answer matches its own parameters
    futs = [pool.submit(infer_pb, ch, req_of("quant.per_token", {"x": (xs[k], "fp32")},
                                            {"out_dtype": "int8" if k % 2 else "fp8_e4m3fn"})) for k in range(12)]
    ok = all(f.result().raw_output_contents[0] ==
             moelib.run("quant.per_token", {"x": (xs[k], "fp32")},
                        {"out_dtype": "int8" if k % 2 else "fp8_e4m3fn"})["q"][0].tobytes() for k, f in enumerate(futs))
    check(ok, "mixed parameters in flight: each bit-equal to its own parameters")
    pool.shutdown()
    cli = tc.InferenceServerClient(ts.TARGET)
    for model in ("bf16set", "quant.mx"):
        st = cli.get_inference_statistics(model).model_stats[0]
        sizes = {b.batch_size: b.compute_infer.count for b in st.batch_stats}
        check(any(s > 1 for s in sizes) and st.execution_count < st.inference_count,
              f"{model}: batches formed (batch size: executions {sizes}; {st.inference_count} requests in "
              f"{st.execution_count} executions)")


def test_unload_in_flight(cli, ch, repo):
    rng = np.random.default_rng(14)
    pool = cf.ThreadPoolExecutor(16)
    cases = [routed_inputs(rng, 64, 128, 8) for _ in range(16)]
    refs = [oracle(f"{repo}/bf16set", c).tobytes() for c in cases]
    futs = [pool.submit(lambda c=c: code_of(lambda: infer_pb(ch, req_of("bf16set", c)))) for c in cases]
    r = subprocess.run([MOEC, "-a", ts.TARGET, "models"], capture_output=True, text=True)  # let some start
    cli.unload_model("bf16set")
    outcomes = []
    for f, k in zip(futs, range(16)):
        code, msg = f.result()
        outcomes.append(code)
    # each request either ran on the set (holding it) or found it gone
    good = all(c in (SC.OK, SC.NOT_FOUND) for c in outcomes)
    check(good and r.returncode == 0, f"unload with requests in flight: {[c.name for c in outcomes]}")
    check(not cli.is_model_ready("bf16set"), "unloaded set not ready")
    idx = {m.name: m.state for m in cli.get_model_repository_index().models}
    check(idx.get("bf16set") == "UNAVAILABLE", f"unloaded set listed UNAVAILABLE ({idx.get('bf16set')})")
    cli.load_model("bf16set")
    got = infer_pb(ch, req_of("bf16set", cases[0])).raw_output_contents[0]
    check(got == refs[0], "reloaded set answers bit-equal")
    pool.shutdown()


def test_file_changed(cli, ch, repo):
    """A served set's weights file truncated, then rewritten in place: moed
    keeps serving the weights it loaded (a mapping of the file would SIGBUS);
    only an explicit reload reads the file again."""
    rng = np.random.default_rng(21)
    path = f"{repo}/changedset/weights.safetensors"
    case = routed_inputs(rng, 16, 128, 8)
    ref = oracle(f"{repo}/changedset", case).tobytes()
    check(infer_pb(ch, req_of("changedset", case)).raw_output_contents[0] == ref, "set to change answers")
    orig = open(path, "rb").read()
    os.truncate(path, 4)  # in place: the same inode
    check(infer_pb(ch, req_of("changedset", case)).raw_output_contents[0] == ref,
          "file truncated under a served set: same answer")
    with open(path, "r+b") as f:
        f.write(b"\xa5" * len(orig))
    check(infer_pb(ch, req_of("changedset", case)).raw_output_contents[0] == ref,
          "file rewritten under a served set: same answer")
    code, msg = code_of(lambda: cli.load_model("changedset"))
    check(code != SC.OK and "weights.safetensors" in msg, f"reload of the rewritten file fails ({code}: {msg})")
    check(infer_pb(ch, req_of("changedset", case)).raw_output_contents[0] == ref,
          "failed reload: the loaded set still answers")
    with open(path, "r+b") as f:
        f.write(orig)
    cli.load_model("changedset")
    check(infer_pb(ch, req_of("changedset", case)).raw_output_contents[0] == ref, "explicit reload serves again")


def test_broken_set(cli):
    code, msg = code_of(lambda: cli.load_model("broken"))
    check(code != SC.OK and "w13" in msg, f"RepositoryModelLoad of a broken set names the tensor ({code}: {msg})")
    check(not cli.is_model_ready("broken"), "broken set not ready")


def upload_msgs(header=None, tensors=(), chunk=3000):
    """Hand-encoded moe.v1.UploadRequest messages (no generated Python code)."""
    def varint(n):
        out = b""
        while True:
            b, n = n & 0x7F, n >> 7
            if n:
                out += bytes([b | 0x80])
            else:
                return out + bytes([b])

    def f(num, data):
        return varint(num << 3 | 2) + varint(len(data)) + data
    msgs = []
    if header:
        name, cfg, replace = header
        msgs.append(f(1, f(1, name.encode()) + f(2, cfg.encode()) + (b"\x18\x01" if replace else b"")))
    for name, dtype, shape, nbytes, data in tensors:
        th = f(1, name.encode()) + f(2, dtype.encode()) + f(3, b"".join(varint(s) for s in shape)) + \
            varint(4 << 3) + varint(nbytes)
        first = True
        for off in range(0, max(len(data), 1), chunk):
            msgs.append(f(2, (f(1, th) if first else b"") + f(2, data[off:off + chunk])))
            first = False
    return msgs


def test_upload(cli, ch, repo, tmp):
    env = dict(os.environ, MOEC_ADDRESS=ts.TARGET)
    r = subprocess.run([MOEC, "upload", f"{repo}/wnaset", "--name", "uploaded", "--chunk-bytes", "10000"],
                       env=env, capture_output=True, text=True)
    check(r.returncode == 0 and "verified" in r.stdout, f"moec upload ({r.stdout.strip()} {r.stderr.strip()})")
    check(os.path.exists(f"{repo}/uploaded/config.json"), "upload stored as an expert-set directory")
    rng = np.random.default_rng(15)
    x = rng.standard_normal((4, 128)).astype(np.float16).view(np.uint16)
    ins = {"hidden_states": (x, "fp16"), "router_logits": (rng.standard_normal((4, 8)).astype(np.float32), "fp32")}
    got = infer_pb(ch, req_of("uploaded", ins)).raw_output_contents[0]
    check(got == oracle(f"{repo}/wnaset", ins).tobytes(), "uploaded set serves bit-equal results")
    r = subprocess.run([MOEC, "upload", f"{repo}/wnaset", "--name", "uploaded"], env=env, capture_output=True, text=True)
    check(r.returncode != 0 and "ALREADY_EXISTS" in r.stderr, f"upload over an existing name refused ({r.stderr.strip()})")
    r = subprocess.run([MOEC, "upload", f"{repo}/fp16set", "--name", "uploaded", "--replace"], env=env,
                       capture_output=True, text=True)
    x = rng.standard_normal((3, 128)).astype(np.float16).view(np.uint16)
    ins = {"hidden_states": (x, "fp16"), "router_logits": (rng.standard_normal((3, 8)).astype(np.float32), "fp32")}
    got = infer_pb(ch, req_of("uploaded", ins)).raw_output_contents[0]
    check(r.returncode == 0 and got == oracle(f"{repo}/fp16set", ins).tobytes(), "upload --replace swaps the set")

    up = ch.stream_unary("/moe.v1.ExpertStore/Upload", request_serializer=lambda b: b,
                         response_deserializer=lambda b: b)
    cfg = open(f"{repo}/bf16set/config.json").read()
    w = read_safetensors(f"{repo}/bf16set/weights.safetensors")
    w13, w2 = w["w13"][0], w["w2"][0]
    t13 = ("w13", "bf16", list(w13.shape), w13.nbytes, w13.tobytes())
    t2 = ("w2", "bf16", list(w2.shape), w2.nbytes, w2.tobytes())
    bad = [
        ("chunk before header", upload_msgs(None, [t13]), SC.INVALID_ARGUMENT, "header"),
        ("bad config", upload_msgs(("u2", "{\"num_experts\": 0}", False), [t13]), SC.INVALID_ARGUMENT, "config_json"),
        ("bad name", upload_msgs(("../u2", cfg, False), [t13]), SC.INVALID_ARGUMENT, "header.name"),
        ("unknown tensor", upload_msgs(("u2", cfg, False), [("w99", "bf16", [4], 8, b"x" * 8)]),
         SC.INVALID_ARGUMENT, "chunk.tensor.name"),
        ("nbytes mismatch", upload_msgs(("u2", cfg, False), [("w13", "bf16", list(w13.shape), 10, b"x" * 10)]),
         SC.INVALID_ARGUMENT, "chunk.tensor.nbytes"),
        ("overflowing shape", upload_msgs(("u2", cfg, False), [("w13", "bf16", [2**62, 2**62], 8, b"")]),
         SC.INVALID_ARGUMENT, "chunk.tensor.shape"),
        ("data beyond tensor", upload_msgs(("u2", cfg, False), [("w2", "bf16", [2], 4, b"x" * 9)]),
         SC.INVALID_ARGUMENT, "chunk.data"),
        ("truncated tensor", upload_msgs(("u2", cfg, False), [(*t13[:4], t13[4][:1000])]),
         SC.INVALID_ARGUMENT, "missing"),
        ("missing w2", upload_msgs(("u2", cfg, False), [t13]), SC.INVALID_ARGUMENT, "w2"),
        ("over the upload limit", upload_msgs(("u2", cfg, False), [("w13", "bf16", [1 << 20, 4], 8 << 20, b"")]),
         SC.RESOURCE_EXHAUSTED, "limit"),
        ("garbage", [b"\xff\xff\xff\xff\x0f"], SC.INVALID_ARGUMENT, "UploadRequest"),
        ("empty stream", [], SC.INVALID_ARGUMENT, "header"),
    ]
    for what, msgs, want, word in bad:
        code, msg = code_of(lambda: up(iter(msgs), timeout=30))
        check(code == want and word in msg, f"upload {what}: {code.name} ({msg})")
    check(not any(n.startswith(".upload") for n in os.listdir(repo)), "failed uploads leave no files behind")
    resp = up(iter(upload_msgs(("u2", cfg, False), [t13, t2])), timeout=30)
    check(resp.startswith(b"\n\x02u2"), "raw grpc upload of a bf16 set")
    ins = routed_inputs(rng, 3, 128, 8)
    check(infer_pb(ch, req_of("u2", ins)).raw_output_contents[0] == oracle(f"{repo}/bf16set", ins).tobytes(),
          "raw-uploaded set bit-equal")


def wait_for(cond, seconds=15):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.1)
    return False


def test_control_modes(tmp, repo):
    """--model-control-mode none / explicit / poll and --load-model (Triton's flags)."""
    def none_mode(cli, ch):
        code, msg = code_of(lambda: cli.unload_model("bf16set"))
        check(code == grpc.StatusCode.FAILED_PRECONDITION and "model-control-mode none" in msg and
              cli.is_model_ready("bf16set"),
              f"mode none: every set loaded, unload refused FAILED_PRECONDITION naming the flag ({code} {msg})")

    def explicit_mode(cli, ch):
        check(cli.is_model_ready("bf16set") and not cli.is_model_ready("fp16set"),
              "mode explicit: only the --load-model set is loaded")
        cli.load_model("fp16set")
        check(cli.is_model_ready("fp16set"), "mode explicit: RepositoryModelLoad loads another")

    def hidden_type(cli, name):
        try:
            return {t.name: t.datatype for t in cli.get_model_metadata(name).inputs}["hidden_states"]
        except tc.InferenceServerException:
            return None

    def poll_mode(cli, ch):
        check(cli.is_model_ready("bf16set") and cli.is_model_ready("fp16set"), "mode poll: every set loaded")
        code, msg = code_of(lambda: cli.load_model("fp16set"))
        check(code == grpc.StatusCode.FAILED_PRECONDITION and "model-control-mode poll" in msg,
              f"mode poll: RepositoryModelLoad refused naming the flag ({code} {msg})")
        shutil.copytree(f"{repo}/fp16set", f"{repo}/polled")
        check(wait_for(lambda: hidden_type(cli, "polled") == "FP16"), "mode poll: a new set directory is loaded")
        shutil.rmtree(f"{repo}/polled")
        shutil.copytree(f"{repo}/bf16set", f"{repo}/polled")
        check(wait_for(lambda: hidden_type(cli, "polled") == "BF16"), "mode poll: a changed set is reloaded")
        shutil.rmtree(f"{repo}/polled")
        check(wait_for(lambda: not cli.is_model_ready("polled")), "mode poll: a removed set is unloaded")
        check(cli.is_model_ready("bf16set"), "mode poll: the unchanged sets stay")
    ts.serve(tmp, ["--model-repository", repo, "--model-control-mode", "none"], none_mode)
    ts.serve(tmp, ["--model-repository", repo, "--model-control-mode", "explicit", "--load-model", "bf16set"],
             explicit_mode)
    ts.serve(tmp, ["--model-repository", repo, "--model-control-mode", "poll", "--repository-poll-secs", "1"],
             poll_mode)
    for extra, want in ((["--model-control-mode", "explicit", "--load-model", "nosuch"], "--load-model nosuch"),
                        (["--load-model", "bf16set"], "needs --model-control-mode explicit"),
                        (["--model-control-mode", "sometimes"], "'sometimes' for --model-control-mode"),
                        (["--model-control-mode", "poll", "--repository-poll-secs", "0"],
                         "'0' for --repository-poll-secs"),
                        # an interval without poll mode would poll nothing, silently
                        (["--repository-poll-secs", "5"], "--repository-poll-secs needs --model-control-mode poll"),
                        (["--model-control-mode", "explicit", "--repository-poll-secs", "5"],
                         "--repository-poll-secs needs --model-control-mode poll")):
        r = subprocess.run([MOED, "--model-repository", repo, "--grpc-port", "0", "--http-port", "-1", *extra],
                           capture_output=True, text=True, timeout=60)
        check(r.returncode != 0 and want in r.stderr, f"{extra}: refuses to start ({r.returncode}: {r.stderr.strip()})")
    r = subprocess.run([MOED, "--model-control-mode", "poll", "--grpc-port", "0", "--http-port", "-1"],
                       capture_output=True, text=True, timeout=60)
    check(r.returncode != 0 and "poll needs --model-repository" in r.stderr,
          f"poll without a repository refuses to start ({r.stderr.strip()})")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        repo = os.path.join(tmp, "repo")
        mkset(f"{repo}/bf16set", "bf16")
        mkset(f"{repo}/fp16set", "fp16", extra=["--seed", "3"])
        mkset(f"{repo}/wnaset", "wna16", extra=["--bits", "4", "--group-size", "64", "--zero-points"])
        mkset(f"{repo}/changedset", "bf16", extra=["--seed", "5"])
        mkset(f"{tmp}/small", "bf16", hidden=64)
        shutil.copytree(f"{repo}/bf16set", f"{repo}/broken")
        shutil.copy(f"{tmp}/small/weights.safetensors", f"{repo}/broken/weights.safetensors")
        with moed(tmp, "--model-repository", repo, "--max-queue-delay-us", "20000",
                  "--cache-host", "--max-upload-bytes", str(4 << 20)) as (_, port, http_port):
            ts.TARGET = f"127.0.0.1:{port}"
            cli = tc.InferenceServerClient(ts.TARGET)
            ch = grpc.insecure_channel(ts.TARGET, options=[("grpc.max_send_message_length", 1 << 30),
                                                           ("grpc.max_receive_message_length", 1 << 30)])
            test_repository_sets(cli, ch, repo)
            test_inline(ch, repo, http_port)
            test_batching(ch, repo)
            test_unload_in_flight(cli, ch, repo)
            test_broken_set(cli)
            test_file_changed(cli, ch, repo)
            test_upload(cli, ch, repo, tmp)
            check(ts.raw_unary(ch, "/inference.GRPCInferenceService/ServerLive")(b"") == b"\x08\x01", "server still up")
        test_control_modes(tmp, repo)
        print_log_tail(tmp)
    exit_with_summary()


if __name__ == "__main__":
    main()
