#!/usr/bin/env python3
"""tools/convert_checkpoint.py on small synthetic checkpoints written in the
upstream layouts (no download), then fused_moe of libmoe on the converted set
against a float64 reference computed from the *upstream* tensors, written
from docs/numerics.md ("Weight scheme fp8", "Weight scheme mxfp4", "Expert
biases"):

- DeepSeek-V3 style: per-expert gate_proj/up_proj/down_proj fp8 e4m3fn with
  128x128 weight_scale_inv, the router's e_score_correction_bias, two layers
  and an attention tensor over two files (--layer picks one). The reference
  quantizes x and a per group of 128 with the contract's codes (ml_dtypes'
  RNE cast), sums each k-block in float64 and scales it by the fp32 product
  of the two scales. Bound: rel L2 <= 4e-3 (bf16).
- gpt-oss style: gate_up_proj_blocks/_scales/_bias (gate and up rows
  interleaved) and down_proj_*; reference w = act(value * 2^(b - 127)),
  biases before the roundings, swiglu_oai. Bound: 1e-3 (bf16).
- bad checkpoints: a shape off by one, an e8m0 0xFF scale, a block size that
  does not divide K, a missing key: exit status 1 and a message naming the key.

    MOE_LIB=.../libmoe.so python test_convert_checkpoint.py
"""
import json
import os
import subprocess
import sys
import tempfile

import ml_dtypes
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
TOOLS = os.path.join(HERE, "..", "..", "tools")
sys.path.insert(0, TOOLS)
CONVERTER = os.path.join(TOOLS, "convert_checkpoint.py")

import moe_reference as ref  # noqa: E402
import moelib  # noqa: E402
from convert_checkpoint import save_safetensors  # noqa: E402

FAILED = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        FAILED.append(what)


def save(path, tensors):
    """tensors: {key: (array, safetensors dtype)} -> one .safetensors file."""
    save_safetensors(path, tensors)


def bf16(v):
    return ref.encode(v, "bf16")


def convert(args):
    p = subprocess.run([sys.executable, CONVERTER] + args, capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout + p.stderr


def run_set(d, x16, ids, w):
    with moelib.ExpertSet(d, name="conv") as es:
        r = moelib.run("fused_moe", {"hidden_states": (x16, "bf16"), "topk_ids": (ids, "int32"),
                                     "topk_weights": (w, "fp32")}, expert_set=es.ptr)
    return ref.decode(r["output"][0], "bf16")


def routing(rng, T, E, k):
    ids = np.array([rng.choice(E, k, replace=False) for _ in range(T)], dtype=np.int32)
    w = rng.uniform(0.1, 0.6, (T, k)).astype(np.float32)
    return ids, w


# ---- DeepSeek-V3 ------------------------------------------------------------------------

E8 = ml_dtypes.float8_e4m3fn


def fp8_codes(rng, shape):
    return rng.uniform(-224, 224, shape).astype(np.float32).astype(E8).view(np.uint8)


def fp8_value(codes):
    return codes.view(E8).astype(np.float64)


def quant_groups(v, G):
    """quant.per_token_group of one row (fp32 arithmetic, fast division): values of the codes, scales."""
    v = v.astype(np.float32).reshape(-1, G)
    amax = np.max(np.abs(v), axis=1).astype(np.float32)
    s = (amax / np.float32(448.0)).astype(np.float32)
    s[s == 0] = 1.0
    r = (np.float32(1.0) / s).astype(np.float32)
    q = (v * r[:, None]).astype(np.float32).astype(E8).astype(np.float64)
    return q.reshape(-1), s


def fp8_gemm(xq, sx, wq, sw, B):
    """acc[n] = SUM_b p_b * (sx[b] * sw[n / B, b]) with p_b in float64."""
    N, K = wq.shape
    acc = np.zeros(N)
    for b in range(K // B):
        p = wq[:, b * B:(b + 1) * B] @ xq[b * B:(b + 1) * B]
        sc = (np.float32(sx[b]) * sw[np.arange(N) // B, b].astype(np.float32)).astype(np.float64)
        acc += p * sc
    return acc


def deepseek_case(tmp):
    rng = np.random.default_rng(14)
    E, H, I, B, T, k = 4, 256, 128, 128, 12, 2
    pre = "model.layers.3.mlp."
    gate, up, down, sg, su, sd = [], [], [], [], [], []
    f1, f2 = {}, {}
    for e in range(E):
        for name, (n, kk), lst, slst in (("gate_proj", (I, H), gate, sg), ("up_proj", (I, H), up, su),
                                         ("down_proj", (H, I), down, sd)):
            q = fp8_codes(rng, (n, kk))
            s = (rng.uniform(0.75, 1.25, (-(-n // B), -(-kk // B))) * np.sqrt(3.0 / kk) / 224).astype(np.float32)
            lst.append(q)
            slst.append(s)
            dst = f1 if e < 2 else f2  # experts over two shards, as published checkpoints are
            dst[f"{pre}experts.{e}.{name}.weight"] = (q, "F8_E4M3")
            dst[f"{pre}experts.{e}.{name}.weight_scale_inv"] = (s, "F32")
    bias = rng.uniform(-0.1, 0.1, E).astype(np.float32)
    f1[f"{pre}gate.e_score_correction_bias"] = (bias, "F32")
    f1[f"{pre}gate.weight"] = (bf16(rng.standard_normal((E, H))), "BF16")
    f1["model.layers.3.self_attn.q_proj.weight"] = (bf16(rng.standard_normal((8, H))), "BF16")
    f2["model.layers.4.mlp.experts.0.gate_proj.weight"] = (fp8_codes(rng, (I, H)), "F8_E4M3")  # another layer
    ck = os.path.join(tmp, "dsv3")
    os.makedirs(ck)
    save(os.path.join(ck, "model-00001-of-00002.safetensors"), f1)
    save(os.path.join(ck, "model-00002-of-00002.safetensors"), f2)

    rc, out = convert(["--input", ck, "--out", os.path.join(tmp, "dsv3_set"), "--top-k", str(k)])
    check(rc == 1 and "--layer" in out, f"deepseek: two MoE layers without --layer refused ({out.strip()})")
    d = os.path.join(tmp, "dsv3_set")
    rc, out = convert(["--input", ck, "--layer", "3", "--out", d, "--top-k", str(k)])
    check(rc == 0, f"deepseek: converted ({out.strip()})")
    if rc:
        return
    cfg = json.load(open(os.path.join(d, "config.json")))
    check(cfg["scheme"] == "fp8" and cfg["weight_scale"] == "block" and cfg["block_k"] == B
          and cfg["num_experts"] == E and cfg["hidden_size"] == H and cfg["intermediate_size"] == I
          and cfg["scoring"] == "sigmoid", f"deepseek: config {cfg}")

    x = ref.decode(bf16(rng.standard_normal((T, H))), "bf16")
    ids, w = routing(rng, T, E, k)
    got = run_set(d, bf16(x), ids, w)
    want = np.zeros((T, H))
    for t in range(T):
        xq, sx = quant_groups(x[t], B)
        for j in range(k):
            e = ids[t, j]
            g = ref.act(fp8_gemm(xq, sx, fp8_value(gate[e]), sg[e], B), "bf16")
            u = ref.act(fp8_gemm(xq, sx, fp8_value(up[e]), su[e], B), "bf16")
            a = ref.act(ref.act(ref.silu(g), "bf16") * u, "bf16")
            aq, sa = quant_groups(a, B)
            want[t] += ref.act(fp8_gemm(aq, sa, fp8_value(down[e]), sd[e], B) * float(w[t, j]), "bf16")
    want = ref.act(want, "bf16")
    err = ref.rel_err(got, want)
    check(np.all(np.isfinite(got)) and err <= 4e-3, f"deepseek: fused_moe on the converted set, rel L2 {err:.3g} <= 4e-3")

    # bad: a scale of the wrong shape, a block that does not divide K
    f1[f"{pre}experts.1.up_proj.weight_scale_inv"] = (np.ones((1, 3), np.float32), "F32")
    save(os.path.join(ck, "model-00001-of-00002.safetensors"), f1)
    rc, out = convert(["--input", ck, "--layer", "3", "--out", os.path.join(tmp, "bad"), "--top-k", "2"])
    check(rc == 1 and "experts.1.up_proj.weight_scale_inv: shape [1, 3], expected [1, 2]" in out,
          f"deepseek: bad scale shape named ({out.strip()})")
    rc, out = convert(["--input", ck, "--layer", "3", "--out", os.path.join(tmp, "bad"), "--top-k", "2",
                       "--block", "128", "96"])
    check(rc == 1 and "BK must divide" in out, f"deepseek: block not dividing K refused ({out.strip()})")


# ---- gpt-oss ------------------------------------------------------------------------------

FP4 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6])


def mx_dequant(blocks, scales):
    """[N, K/32, 16] codes (low nibble first), [N, K/32] e8m0 -> act(value * 2^(b-127)) [N, K]."""
    lo, hi = FP4[blocks & 15], FP4[blocks >> 4]
    v = np.stack([lo, hi], axis=-1).reshape(blocks.shape[0], blocks.shape[1], 32)
    v = v * np.ldexp(1.0, scales.astype(np.int64) - 127)[:, :, None]
    return ref.act(v.reshape(blocks.shape[0], -1), "bf16")


def gpt_oss_case(tmp):
    rng = np.random.default_rng(41)
    E, H, I, T, k = 4, 128, 64, 12, 2
    pre = "model.layers.0.mlp.experts."

    def scales(shape, K):
        base = 127 + int(np.floor(np.log2(1.0 / (2.93 * np.sqrt(K)))))
        return (base + rng.integers(0, 2, shape)).astype(np.uint8)

    t = {pre + "gate_up_proj_blocks": (rng.integers(0, 256, (E, 2 * I, H // 32, 16), dtype=np.uint8), "U8"),
         pre + "gate_up_proj_scales": (scales((E, 2 * I, H // 32), H), "U8"),
         pre + "gate_up_proj_bias": (bf16(rng.uniform(-0.25, 0.25, (E, 2 * I))), "BF16"),
         pre + "down_proj_blocks": (rng.integers(0, 256, (E, H, I // 32, 16), dtype=np.uint8), "U8"),
         pre + "down_proj_scales": (scales((E, H, I // 32), I), "U8"),
         pre + "down_proj_bias": (bf16(rng.uniform(-0.25, 0.25, (E, H))), "BF16"),
         "model.layers.0.mlp.router.weight": (bf16(rng.standard_normal((E, H))), "BF16")}
    ck = os.path.join(tmp, "gptoss")
    os.makedirs(ck)
    save(os.path.join(ck, "model.safetensors"), t)
    d = os.path.join(tmp, "gptoss_set")
    rc, out = convert(["--input", ck, "--out", d, "--top-k", str(k)])
    check(rc == 0, f"gpt-oss: converted ({out.strip()})")
    if rc:
        return
    cfg = json.load(open(os.path.join(d, "config.json")))
    check(cfg["scheme"] == "mxfp4" and cfg["activation"] == "swiglu_oai" and cfg["has_bias"]
          and cfg["hidden_size"] == H and cfg["intermediate_size"] == I, f"gpt-oss: config {cfg}")

    x = ref.decode(bf16(rng.standard_normal((T, H))), "bf16")
    ids, w = routing(rng, T, E, k)
    got = run_set(d, bf16(x), ids, w)
    b13 = ref.decode(t[pre + "gate_up_proj_bias"][0], "bf16")
    b2 = ref.decode(t[pre + "down_proj_bias"][0], "bf16")
    want = np.zeros((T, H))
    for tt in range(T):
        for j in range(k):
            e = ids[tt, j]
            w13 = mx_dequant(t[pre + "gate_up_proj_blocks"][0][e], t[pre + "gate_up_proj_scales"][0][e])
            w2 = mx_dequant(t[pre + "down_proj_blocks"][0][e], t[pre + "down_proj_scales"][0][e])
            gu = w13 @ x[tt] + b13[e]  # the bias follows its (interleaved) row
            g = np.minimum(ref.act(gu[0::2], "bf16"), 7.0)
            u = np.clip(ref.act(gu[1::2], "bf16"), -7.0, 7.0)
            a = ref.act((u + 1.0) * g * (1.0 / (1.0 + np.exp(-1.702 * g))), "bf16")
            want[tt] += ref.act((w2 @ a + b2[e]) * float(w[tt, j]), "bf16")
    want = ref.act(want, "bf16")
    err = ref.rel_err(got, want)
    check(np.all(np.isfinite(got)) and err <= 1e-3, f"gpt-oss: fused_moe on the converted set, rel L2 {err:.3g} <= 1e-3")

    # bad: an e8m0 0xFF scale, a bias of the wrong shape, a missing key
    s = t[pre + "down_proj_scales"][0].copy()
    s[2, 7, 1] = 0xFF
    bad = dict(t)
    bad[pre + "down_proj_scales"] = (s, "U8")
    save(os.path.join(ck, "model.safetensors"), bad)
    rc, out = convert(["--input", ck, "--out", os.path.join(tmp, "bad2"), "--top-k", "2"])
    check(rc == 1 and "down_proj_scales: e8m0 scale byte 0xFF (NaN) at [2, 7, 1]" in out,
          f"gpt-oss: 0xFF scale named ({out.strip()})")
    bad = dict(t)
    bad[pre + "down_proj_bias"] = (bf16(np.zeros((E, H + 1))), "BF16")
    save(os.path.join(ck, "model.safetensors"), bad)
    rc, out = convert(["--input", ck, "--out", os.path.join(tmp, "bad2"), "--top-k", "2"])
    check(rc == 1 and "down_proj_bias: shape [4, 129], expected [4, 128]" in out, f"gpt-oss: bias shape named ({out.strip()})")
    bad = dict(t)
    del bad[pre + "gate_up_proj_scales"]
    save(os.path.join(ck, "model.safetensors"), bad)
    rc, out = convert(["--input", ck, "--out", os.path.join(tmp, "bad2"), "--top-k", "2"])
    check(rc == 1 and "gate_up_proj_scales: missing" in out, f"gpt-oss: missing key named ({out.strip()})")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        deepseek_case(tmp)
        gpt_oss_case(tmp)
    print(f"{len(FAILED)} failed")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
