#!/usr/bin/env python3
"""fused_moe's fp8 and mxfp4 schemes and expert biases (inline weights) of
libmoe against an independent float64 reference written from
docs/numerics.md ("Weight scheme fp8", "Weight scheme mxfp4", "Expert
biases", "Tolerances"):

- fp8: x and a are quantized with quant_oracle's own quant ops (its exact
  e4m3fn grid arithmetic, not the C codecs): quant.per_token_group with G = BK
  for block scales, quant.per_token for per_channel and dynamic per_tensor,
  static quant.per_tensor with the expert's a13_scale / a2_scale; the GEMM is
  the contract's (float64 sums per k-block, scaled by the fp32 product of the
  two scales, blocks in ascending order; (p * sx) * sw without blocks).
  Bound: rel L2 <= 4e-3 (BF16), 2e-3 (F16).
- mxfp4: w = act(value * 2^(b - 127)) from the e2m1 value table. Bound 1e-3 /
  2.5e-4, as for the 16-bit schemes with biases.
- biases (F32 or the activation dtype) added before the rounding of g, u
  and y (before the routed weight); with swiglu_oai they follow the
  interleaved rows.
- batch invariance: each token's output bits alone equal its bits in the batch.

    MOE_LIB=.../libmoe.so python test_fused_moe_schemes_ref.py
"""
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import moe_reference as ref  # noqa: E402
import moelib  # noqa: E402
import quant_oracle as qo  # noqa: E402

F8 = "fp8_e4m3fn"
FP4 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6])
FAILED = []

CASES = [
    dict(scheme="fp8", ws="block", bn=128, bk=128, dt="bf16", act="silu", H=256, I=128),
    dict(scheme="fp8", ws="block", bn=64, bk=32, dt="fp16", act="gelu", H=128, I=96, bias="fp32"),
    dict(scheme="fp8", ws="block", bn=40, bk=48, dt="bf16", act="swiglu_oai", H=96, I=144, bias="bf16"),
    dict(scheme="fp8", ws="per_channel", dt="bf16", act="swiglu_oai", H=96, I=80, bias="bf16"),
    dict(scheme="fp8", ws="per_tensor", dt="fp16", act="silu", H=64, I=48, exact=True),
    dict(scheme="fp8", ws="per_tensor", static=True, dt="bf16", act="gelu", H=128, I=64, bias="fp32"),
    dict(scheme="fp8", ws="per_tensor", static=True, dt="fp16", act="silu", H=64, I=64, exact=True),
    dict(scheme="mxfp4", dt="bf16", act="swiglu_oai", H=128, I=64, bias="bf16"),
    dict(scheme="mxfp4", dt="fp16", act="silu", H=96, I=64),
    dict(scheme="mxfp4", dt="fp16", act="gelu", H=64, I=96, bias="fp16"),
    dict(scheme="bf16", dt="bf16", act="gelu", H=72, I=40, bias="fp32"),
    dict(scheme="fp16", dt="fp16", act="swiglu_oai", H=64, I=48, bias="fp16"),
]


def store(v, dt):
    return v.astype(np.float32) if dt == "fp32" else ref.encode(v, dt)


def load(a, dt):
    return ref.decode(a, dt)


def make_weights(c, rng, E):
    """Inline weight inputs {name: (array, dtype)} and the reference's view of them."""
    H, I, dt = c["H"], c["I"], c["dt"]
    ins, w = {}, {}
    for g, (N, K) in (("w13", (2 * I, H)), ("w2", (H, I))):
        if c["scheme"] == "fp8":
            codes = qo.cvt_codes(rng.uniform(-224, 224, (E, N, K)).astype(np.float32), F8).astype(np.uint8)
            if c["ws"] == "block":
                sshape = (E, -(-N // c["bn"]), K // c["bk"])
            elif c["ws"] == "per_channel":
                sshape = (E, N)
            else:
                sshape = (E,)
            s = (rng.uniform(0.75, 1.25, sshape) * np.sqrt(3.0 / K) / 224).astype(np.float32)
            ins[g + "_qweight"], ins[g + "_scales"] = (codes, "uint8"), (s, "fp32")
            w[g] = (qo.decode_codes(codes, F8).astype(np.float64), s)
            if c.get("static"):
                a = (rng.uniform(0.75, 1.25, E) * 4.0 / 448).astype(np.float32)
                ins["a13_scale" if g == "w13" else "a2_scale"] = (a, "fp32")
                w[g + "_a"] = a
        elif c["scheme"] == "mxfp4":
            codes = rng.integers(0, 256, (E, N, K // 2), dtype=np.uint8)
            base = 127 + int(np.floor(np.log2(1.0 / (2.93 * np.sqrt(K)))))
            sb = (base + rng.integers(0, 2, (E, N, K // 32))).astype(np.uint8)
            ins[g + "_qweight"], ins[g + "_scales"] = (codes, "uint8"), (sb, "uint8")
            vals = np.stack([FP4[codes & 15], FP4[codes >> 4]], axis=-1).reshape(E, N, K)
            w[g] = ref.act(vals * np.repeat(np.ldexp(1.0, sb.astype(np.int64) - 127), 32, axis=2), dt)
        else:
            v = store(rng.uniform(-1, 1, (E, N, K)) * np.sqrt(3.0 / K), dt)
            ins[g] = (v, dt)
            w[g] = load(v, dt)
        if c.get("bias"):
            b = store(rng.uniform(-0.25, 0.25, (E, N)), c["bias"])
            ins[g + "_bias"] = (b, c["bias"])
            w[g + "_b"] = load(b, c["bias"]) if c["bias"] != "fp32" else b.astype(np.float64)
    return ins, w


def quant_input(c, v, w, g, e):
    """fp8: the GEMM input v (act values) as its codes' values, and its scales per K block."""
    v32 = v.astype(np.float32)
    exact = bool(c.get("exact"))
    if c["ws"] == "block":
        q, s = qo.quant_per_token_group(v32[None], F8, group_size=c["bk"], exact_division=exact)
    elif c.get("static"):
        q, s = qo.quant_per_tensor(v32[None], F8, scale=w[g + "_a"][e], exact_division=exact)
    else:
        q, s = qo.quant_per_token(v32[None], F8, exact_division=exact)
    return qo.decode_codes(q[0], F8).astype(np.float64), np.asarray(s, np.float32).reshape(-1)


def gemm(c, w, g, e, v):
    """The fp32 GEMM result (before bias and rounding), in float64."""
    if c["scheme"] != "fp8":
        return w[g][e] @ v
    codes, sw = w[g]
    xq, sx = quant_input(c, v, w, g, e)
    W = codes[e]
    if c["ws"] != "block":
        swn = sw[e] if c["ws"] == "per_channel" else np.full(W.shape[0], sw[e], np.float32)
        return (W @ xq) * float(sx[0]) * swn.astype(np.float64)
    B, BN = c["bk"], c["bn"]
    acc = np.zeros(W.shape[0])
    rows = np.arange(W.shape[0]) // BN
    for b in range(W.shape[1] // B):
        p = W[:, b * B:(b + 1) * B] @ xq[b * B:(b + 1) * B]
        acc += p * (np.float32(sx[b]) * sw[e][rows, b].astype(np.float32)).astype(np.float64)
    return acc


def reference(c, w, x, ids, tw):
    dt, I = c["dt"], c["I"]
    out = np.zeros((x.shape[0], c["H"]))
    bias = c.get("bias")
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = gemm(c, w, "w13", e, x[t]) + (w["w13_b"][e] if bias else 0.0)
            if c["act"] == "swiglu_oai":
                g = np.minimum(ref.act(gu[0::2], dt), 7.0)
                u = np.clip(ref.act(gu[1::2], dt), -7.0, 7.0)
                a = ref.act((u + 1.0) * g * (1.0 / (1.0 + np.exp(-1.702 * g))), dt)
            else:
                g, u = ref.act(gu[:I], dt), ref.act(gu[I:], dt)
                f = ref.silu(g) if c["act"] == "silu" else ref.gelu(g)
                a = ref.act(ref.act(f, dt) * u, dt)
            y = gemm(c, w, "w2", e, a) + (w["w2_b"][e] if bias else 0.0)
            out[t] += ref.act(y * float(tw[t, j]), dt)
    return ref.act(out, dt)


def params_of(c):
    p = {"scheme": c["scheme"], "activation": c["act"]}
    if c["scheme"] == "fp8":
        p["weight_scale"] = c["ws"]
        if c["ws"] == "block":
            p["block_n"], p["block_k"] = c["bn"], c["bk"]
        if c.get("exact"):
            p["exact_division"] = True
    return p


def run_case(i, c):
    rng = np.random.default_rng(1400 + i)
    E, k, T = 6, 2, 11
    ins, w = make_weights(c, rng, E)
    x = ref.decode(ref.encode(rng.standard_normal((T, c["H"])), c["dt"]), c["dt"])
    ids = np.array([rng.choice(E, k, replace=False) for _ in range(T)], dtype=np.int32)
    tw = rng.uniform(0.1, 0.6, (T, k)).astype(np.float32)
    req = {"hidden_states": (ref.encode(x, c["dt"]), c["dt"]), "topk_ids": (ids, "int32"),
           "topk_weights": (tw, "fp32"), **ins}
    outs = moelib.run("fused_moe", req, params_of(c))["output"][0]
    got = ref.decode(outs, c["dt"])
    want = reference(c, w, x, ids, tw)
    tol = (4e-3 if c["dt"] == "bf16" else 2e-3) if c["scheme"] == "fp8" else ref.TOLERANCE[c["dt"]]
    err = ref.rel_err(got, want)
    name = f"#{i} " + " ".join(f"{k}={v}" for k, v in c.items())
    ok = bool(np.all(np.isfinite(got))) and err <= tol
    print(("ok   " if ok else "FAIL ") + f"{name}: rel L2 {err:.3g} (bound {tol:g})")
    if not ok:
        FAILED.append(name)
    # batch invariance: token 3 alone
    one = {**req, "hidden_states": (req["hidden_states"][0][3:4].copy(), c["dt"]), "topk_ids": (ids[3:4].copy(), "int32"),
           "topk_weights": (tw[3:4].copy(), "fp32")}
    alone = moelib.run("fused_moe", one, params_of(c))["output"][0]
    if alone.tobytes() != outs[3:4].tobytes():
        print(f"FAIL {name}: token 3 alone differs from the batch")
        FAILED.append(name + " (batch invariance)")


def main():
    for i, c in enumerate(CASES):
        run_case(i, c)
    print(f"{len(CASES) - len(FAILED)} passed, {len(FAILED)} failed")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
