"""Integration test: the weight schemes of issue 14 over the wire through moed:
fp8 W8A8 (block scales, DeepSeek-V3 style) and mxfp4 W4A16 with expert biases
and swiglu_oai (gpt-oss style), as repository sets (moe-mkset) and as inline
weights of the built-in fused_moe; merged batches; bad input answered
INVALID_ARGUMENT naming the tensor. Every result must be bit-equal to libmoe
called directly (tests/oracle/moelib.py).

env: MOED, MOEC, MOE_LIB, MOE_MKSET."""
import concurrent.futures as cf
import os
import sys
import tempfile

import grpc
import numpy as np
import tritonclient.grpc as tc

sys.path.insert(0, os.path.dirname(__file__))
from moed_process import check, exit_with_summary, moed, print_log_tail  # noqa: E402
import test_fused_moe as tf  # noqa: E402  (mkset, read_safetensors, req_of, oracle)
import test_server as ts  # noqa: E402
from test_server import code_of, infer_pb  # noqa: E402

moelib = ts.moelib
SC = grpc.StatusCode
E, H, I, K = 8, 256, 128, 2


def routed(rng, tokens, act="bf16"):
    x = rng.standard_normal((tokens, H)).astype(np.float32)
    xs = tf.bf16(x) if act == "bf16" else x.astype(np.float16).view(np.uint16)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(tokens)]).astype(np.int32)
    return {"hidden_states": (xs, act), "topk_ids": (ids, "int32"),
            "topk_weights": (rng.random((tokens, K)).astype(np.float32), "fp32")}


def test_sets(cli, ch, repo):
    rng = np.random.default_rng(21)
    for name, act in (("fp8set", "bf16"), ("mxset", "bf16"), ("fp8set", "fp16"), ("mxset", "fp16")):
        ins = routed(rng, 5, act)
        resp = infer_pb(ch, tf.req_of(name, ins))
        ref = tf.oracle(f"{repo}/{name}", ins)
        check(resp.raw_output_contents[0] == ref.tobytes() and list(resp.outputs[0].shape) == [5, H],
              f"{name} ({act} activations): bit-equal over the wire")
    # tritonclient, fp16, router_logits routed with the set's config
    x = rng.standard_normal((3, H)).astype(np.float16)
    lg = rng.standard_normal((3, E)).astype(np.float32)
    i0, i1 = tc.InferInput("hidden_states", [3, H], "FP16"), tc.InferInput("router_logits", [3, E], "FP32")
    i0.set_data_from_numpy(x)
    i1.set_data_from_numpy(lg)
    r = cli.infer("mxset", [i0, i1])
    ref = tf.oracle(f"{repo}/mxset", {"hidden_states": (x.view(np.uint16), "fp16"), "router_logits": (lg, "fp32")})
    check(r.as_numpy("output").view(np.uint16).tobytes() == ref.tobytes(),
          "tritonclient mxfp4 set with biases, router_logits: bit-equal")
    c = cli.get_model_config("fp8set").config
    check("expert_set_config" in c.parameters and '"fp8"' in c.parameters["expert_set_config"].string_value,
          "ModelConfig of an fp8 set shows its config")
    # merged batches: each request bit-equal to the library run alone
    pool = cf.ThreadPoolExecutor(16)
    cases = [routed(rng, 1 + k % 3) for k in range(16)]
    futs = [pool.submit(infer_pb, ch, tf.req_of("fp8set", c)) for c in cases]
    ok = all(f.result().raw_output_contents[0] == tf.oracle(f"{repo}/fp8set", c).tobytes()
             for f, c in zip(futs, cases))
    pool.shutdown()
    check(ok, "16 concurrent fp8 requests: each bit-equal to the library run alone")
    # activations in fp32: the scheme takes 16-bit ones only
    bad = routed(rng, 2)
    bad["hidden_states"] = (rng.standard_normal((2, H)).astype(np.float32), "fp32")
    code, msg = code_of(lambda: infer_pb(ch, tf.req_of("fp8set", bad)))
    check(code == SC.INVALID_ARGUMENT and "hidden_states" in msg and "16-bit" in msg,
          f"fp8 set, fp32 activations refused ({msg})")


def test_inline(ch, repo):
    rng = np.random.default_rng(22)
    mx = tf.read_safetensors(f"{repo}/mxset/weights.safetensors")
    ins = {**routed(rng, 4), **mx}
    params = {"activation": "swiglu_oai"}
    ref = moelib.run("fused_moe", ins, params)["output"][0]
    got = [infer_pb(ch, tf.req_of("fused_moe", ins, params)).raw_output_contents[0] for _ in range(2)]
    check(all(g == ref.tobytes() for g in got), "built-in fused_moe, inline mxfp4 + biases: bit-equal (2 calls)")
    f8 = tf.read_safetensors(f"{repo}/fp8set/weights.safetensors")
    ins = {**routed(rng, 3), **f8}
    params = {"scheme": "fp8", "weight_scale": "block", "block_n": 64, "block_k": 64}
    ref = moelib.run("fused_moe", ins, params)["output"][0]
    got = infer_pb(ch, tf.req_of("fused_moe", ins, params)).raw_output_contents[0]
    check(got == ref.tobytes(), "built-in fused_moe, inline fp8 block weights: bit-equal")
    # a block size the scales do not have, and one that does not divide K
    code, msg = code_of(lambda: infer_pb(ch, tf.req_of("fused_moe", ins, {**params, "block_n": 128})))
    check(code == SC.INVALID_ARGUMENT and "w13_scales" in msg, f"fp8 block_n the scales lack ({msg})")
    code, msg = code_of(lambda: infer_pb(ch, tf.req_of("fused_moe", ins, {**params, "block_k": 96})))
    check(code == SC.INVALID_ARGUMENT and "block_k" in msg, f"fp8 block_k not dividing K ({msg})")
    # an e8m0 0xFF scale in the weights: the tensor and the index
    s = mx["w2_scales"][0].copy()
    s[3, 5, 2] = 0xFF
    bad = {**routed(rng, 2), **mx, "w2_scales": (s, "uint8")}
    code, msg = code_of(lambda: infer_pb(ch, tf.req_of("fused_moe", bad, {"activation": "swiglu_oai"})))
    check(code == SC.INVALID_ARGUMENT and "w2_scales" in msg and "[3, 5, 2]" in msg,
          f"mxfp4 e8m0 0xFF scale refused naming tensor and index ({msg})")
    # a bias of the wrong shape
    bad = {**routed(rng, 2), **mx, "w2_bias": (mx["w2_bias"][0][:, :H // 2].copy(), "fp32")}
    code, msg = code_of(lambda: infer_pb(ch, tf.req_of("fused_moe", bad, {"activation": "swiglu_oai"})))
    check(code == SC.INVALID_ARGUMENT and "w2_bias" in msg, f"bias of the wrong shape refused ({msg})")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        repo = os.path.join(tmp, "repo")
        tf.mkset(f"{repo}/fp8set", "fp8", experts=E, hidden=H, inter=I, top_k=K,
                 extra=["--weight-scale", "block", "--block-n", "64", "--block-k", "64", "--seed", "7"])
        tf.mkset(f"{repo}/mxset", "mxfp4", experts=E, hidden=H, inter=I, top_k=K,
                 extra=["--bias", "--activation", "swiglu_oai", "--seed", "8"])
        with moed(tmp, "--model-repository", repo, "--max-queue-delay-us", "20000") as (_, port, _):
            ts.TARGET = f"127.0.0.1:{port}"
            cli = tc.InferenceServerClient(ts.TARGET)
            ch = grpc.insecure_channel(ts.TARGET, options=[("grpc.max_send_message_length", 1 << 30),
                                                           ("grpc.max_receive_message_length", 1 << 30)])
            test_sets(cli, ch, repo)
            test_inline(ch, repo)
        print_log_tail(tmp)
    exit_with_summary()


if __name__ == "__main__":
    main()
