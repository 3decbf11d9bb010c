"""Independent float64 reference of moe.topk and fused_moe, written from
docs/numerics.md ("Common", "moe.topk", "fused_moe", "Tolerances")
only -- not from the C kernels.

Every rounding point named by the contract is reproduced exactly (RNE to the
activation dtype, done here on float64 values); the sums between them are
computed in float64, so the reference differs from a conforming fp32 backend
only by the backend's fp32 summation error (see docs/numerics.md "Tolerances").

    python moe_reference.py      # runs the self-checks (hand-computed cases)
"""
import json
import math
import struct

import numpy as np

# ----------------------------------------------------------------------------
# Rounding (float64 -> a narrower IEEE binary format, RNE, no flush-to-zero)

# (significand bits incl. the implicit one, min normal exponent, max finite)
_FORMATS = {
    "fp32": (24, -126, float.fromhex("0x1.fffffep127")),
    "bf16": (8, -126, float.fromhex("0x1.fep127")),
    "fp16": (11, -14, 65504.0),
}


def round_to(x, fmt):
    """Round float64 values to `fmt` (fp32/bf16/fp16) with round-to-nearest-
    even, subnormals kept, overflow -> +-inf; result as float64. One rounding
    straight from float64 (no detour through fp32)."""
    p, emin, fmax = _FORMATS[fmt]
    x = np.asarray(x, dtype=np.float64)
    out = np.array(x, dtype=np.float64, copy=True)
    fin = np.isfinite(x) & (x != 0)
    xv = x[fin]
    _, e = np.frexp(xv)              # xv = m * 2^e, 0.5 <= |m| < 1
    e = e - 1                        # xv = 1.f * 2^e
    q = np.maximum(e, emin) - (p - 1)    # exponent of the quantum (ulp)
    r = np.ldexp(np.rint(np.ldexp(xv, -q)), q)   # exact scale, RNE, exact scale back
    # overflow: values that round above max finite become inf.  The rounding
    # threshold is max + half ulp(max); rint already placed r at 2^(emax+1)
    # exactly when the tie/overshoot rounds up.
    r = np.where(np.abs(r) > fmax, np.copysign(np.inf, r), r)
    out[fin] = r
    return out


def act(x, dtype):
    return round_to(x, dtype)


def f32(x):
    return round_to(x, "fp32")


# ----------------------------------------------------------------------------
# Storage <-> float64


def decode(storage, dtype):
    """Storage array (uint16 for bf16/fp16, float32 for fp32) -> float64."""
    a = np.asarray(storage)
    if dtype == "bf16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if dtype == "fp16":
        return a.astype(np.uint16).view(np.float16).astype(np.float64)
    if dtype == "fp32":
        return a.astype(np.float32).astype(np.float64)
    raise ValueError(dtype)


def encode(x, dtype):
    """Float64 values -> storage of `dtype` (rounded RNE first, so exact)."""
    r = round_to(x, dtype)
    if dtype == "bf16":
        b = r.astype(np.float32).view(np.uint32)   # exact: r is a bf16 value
        assert np.all((b & 0xFFFF) == 0) or not np.all(np.isfinite(r))
        return (b >> 16).astype(np.uint16)
    if dtype == "fp16":
        return r.astype(np.float16).view(np.uint16)
    if dtype == "fp32":
        return r.astype(np.float32)
    raise ValueError(dtype)


# ----------------------------------------------------------------------------
# moe.topk


def _scores(logits, scoring):
    x = np.asarray(logits, dtype=np.float64)
    if scoring == "softmax":
        m = x.max(axis=-1, keepdims=True)
        ex = np.exp(x - m)
        return ex / ex.sum(axis=-1, keepdims=True)
    if scoring == "sigmoid":
        return 1.0 / (1.0 + np.exp(-x))
    raise ValueError(scoring)


def _order_desc(keys, idx):
    """Indices `idx` ordered by keys descending, ties -> lower index first."""
    k = keys[idx]
    o = np.lexsort((idx, -k))
    return idx[o]


def _ambiguous(sorted_vals, upto, slack):
    """True when two adjacent values among sorted_vals[0..upto] are distinct
    but so close that fp32 rounding could reorder them (exact ties are fine:
    they are ties in fp32 too)."""
    v = sorted_vals[: upto + 1]
    for i in range(len(v) - 1):
        a, b = v[i], v[i + 1]
        gap = a - b
        if gap != 0 and gap <= 1e-5 * max(abs(a), abs(b)) + slack:
            return True
    return False


def topk_ref(logits, top_k, scoring="softmax", renormalize=False, num_expert_group=0,
             topk_group=0, routed_scaling_factor=1.0, correction_bias=None, with_info=False):
    """logits [T, E] (float64 values of the widened input). Returns
    ids int32 [T, k], weights float64 [T, k] (and, with_info, a bool [T]
    saying which rows have a near-tie that fp32 could resolve differently)."""
    x = np.asarray(logits, dtype=np.float64)
    T, E = x.shape
    s = _scores(x, scoring)
    bias = None if correction_bias is None else np.asarray(correction_bias, dtype=np.float64)
    key = s if bias is None else s + bias
    G = int(num_expert_group or 0)
    ids = np.zeros((T, top_k), dtype=np.int32)
    w = np.zeros((T, top_k), dtype=np.float64)
    amb = np.zeros(T, dtype=bool)
    for t in range(T):
        kt = key[t]
        slack = 1e-6 * (np.abs(s[t]).max() + (0.0 if bias is None else np.abs(bias).max()))
        if G > 1:
            assert E % G == 0
            per = E // G
            kg = kt.reshape(G, per)
            if bias is not None:
                top2 = -np.sort(-kg, axis=1)[:, :2]
                gs = top2.sum(axis=1)
            else:
                gs = kg.max(axis=1)
            gorder = _order_desc(gs, np.arange(G))
            if _ambiguous(gs[gorder], topk_group, slack):
                amb[t] = True
            keep = np.sort(gorder[:topk_group])
            cand = (keep[:, None] * per + np.arange(per)[None, :]).reshape(-1)
        else:
            cand = np.arange(E)
        order = _order_desc(kt, cand)
        if _ambiguous(kt[order], top_k, slack):
            amb[t] = True
        sel = order[:top_k]
        ids[t] = sel
        w[t] = s[t, sel]
    if renormalize:
        w = w / w.sum(axis=1, keepdims=True)
    w = w * routed_scaling_factor
    if with_info:
        return ids, w, amb
    return ids, w


# ----------------------------------------------------------------------------
# wna16 weights


def unpack_int4_k(packed):
    """[.., N, K/2] uint8 -> [.., N, K] values 0..15; byte j holds k=2j in the
    low nibble and k=2j+1 in the high nibble."""
    p = np.asarray(packed, dtype=np.uint8)
    lo = (p & 0x0F).astype(np.int64)
    hi = (p >> 4).astype(np.int64)
    out = np.empty(p.shape[:-1] + (p.shape[-1] * 2,), dtype=np.int64)
    out[..., 0::2] = lo
    out[..., 1::2] = hi
    return out


def unpack_int4_n(packed):
    """Zero points [E, N/2, KG] uint8 -> [E, N, KG]; low nibble = even n."""
    p = np.asarray(packed, dtype=np.uint8)
    E, N2, KG = p.shape
    out = np.empty((E, N2 * 2, KG), dtype=np.int64)
    out[:, 0::2, :] = p & 0x0F
    out[:, 1::2, :] = p >> 4
    return out


def pack_int4_k(q):
    q = np.asarray(q, dtype=np.int64)
    assert q.shape[-1] % 2 == 0 and q.min() >= 0 and q.max() <= 15
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def pack_int4_n(z):
    z = np.asarray(z, dtype=np.int64)
    assert z.shape[1] % 2 == 0 and z.min() >= 0 and z.max() <= 15
    return (z[:, 0::2, :] | (z[:, 1::2, :] << 4)).astype(np.uint8)


def dequant_wna16(qweight, scales, qzeros, bits, group_size, N, K, act_dtype):
    """Returns float64 [E, N, K] weights w = act((q - z) * s) with the product
    an fp32 operation (q - z is exact; one fp32 rounding, then act)."""
    if bits == 4:
        q = unpack_int4_k(qweight)
    else:
        q = np.asarray(qweight, dtype=np.uint8).astype(np.int64)
    E = q.shape[0]
    assert q.shape == (E, N, K), (q.shape, (E, N, K))
    G = K if group_size == -1 else group_size
    assert K % G == 0
    KG = K // G
    s = np.asarray(scales, dtype=np.float64)
    assert s.shape == (E, N, KG), (s.shape, (E, N, KG))
    if qzeros is None:
        z = np.full((E, N, KG), 8 if bits == 4 else 128, dtype=np.int64)
    elif bits == 4:
        z = unpack_int4_n(qzeros)
    else:
        z = np.asarray(qzeros, dtype=np.uint8).astype(np.int64)
    assert z.shape == (E, N, KG)
    sk = np.repeat(s, G, axis=2)
    zk = np.repeat(z, G, axis=2)
    prod = (q - zk).astype(np.float64) * sk      # exact in float64 (<= 9+24 bits)
    return act(f32(prod), act_dtype)


# ----------------------------------------------------------------------------
# fused_moe

_SQRT2 = math.sqrt(2.0)
_erf = np.frompyfunc(math.erf, 1, 1)


def silu(v):
    return v / (1.0 + np.exp(-v))


def gelu(v):
    return 0.5 * v * (1.0 + _erf(v / _SQRT2).astype(np.float64))


def fused_moe_ref(x, topk_ids, topk_weights, w13, w2, act_dtype, activation="silu",
                  expert_offset=0, intermediate_rounding=True):
    """x [T, H] float64 (values of the activation dtype), topk_ids [T, k]
    (global ids), topk_weights [T, k] float64, w13 [E, 2I, H], w2 [E, H, I]
    float64 (dequantized weights), experts held: [offset, offset + E).
    intermediate_rounding=False drops every act() but the output's (used only
    to show that the tolerance enforces the rounding points)."""
    x = np.asarray(x, dtype=np.float64)
    T, H = x.shape
    E, I2, H2 = w13.shape
    assert H2 == H and I2 % 2 == 0
    I = I2 // 2
    assert w2.shape == (E, H, I)
    R = (lambda v: act(v, act_dtype)) if intermediate_rounding else (lambda v: np.asarray(v, np.float64))
    out = np.zeros((T, H), dtype=np.float64)
    k = topk_ids.shape[1]
    for t in range(T):
        for j in range(k):
            e = int(topk_ids[t, j]) - expert_offset
            if e < 0 or e >= E:
                continue           # held by another shard: contributes nothing
            gu = w13[e] @ x[t]     # [2I]
            if activation == "swiglu_oai":
                g = R(gu[0::2])
                u = R(gu[1::2])
                g = np.minimum(g, 7.0)
                u = np.clip(u, -7.0, 7.0)
                a = R((u + 1.0) * g * (1.0 / (1.0 + np.exp(-1.702 * g))))
            else:
                g = R(gu[:I])
                u = R(gu[I:])
                f = silu(g) if activation == "silu" else gelu(g)
                if activation not in ("silu", "gelu"):
                    raise ValueError(activation)
                a = R(R(f) * u)
            y = R((w2[e] @ a) * float(topk_weights[t, j]))
            out[t] += y
    return act(out, act_dtype)


def rel_err(out, ref):
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    d = np.linalg.norm(out - ref)
    n = np.linalg.norm(ref)
    return d / n if n > 0 else (0.0 if d == 0 else math.inf)


TOLERANCE = {"bf16": 1e-3, "fp16": 2.5e-4}


# ----------------------------------------------------------------------------
# safetensors (read only)

_ST_DTYPES = {"BF16": (np.uint16, "bf16"), "F16": (np.uint16, "fp16"), "F32": (np.float32, "fp32"),
              "U8": (np.uint8, "uint8"), "I8": (np.int8, "int8"), "I32": (np.int32, "int32"),
              "F64": (np.float64, "fp64")}


def read_safetensors(path):
    """{name: (array in storage type, moe dtype name)}."""
    with open(path, "rb") as f:
        data = f.read()
    (hlen,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + hlen].decode("utf-8"))
    base = 8 + hlen
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        st, moe = _ST_DTYPES[info["dtype"]]
        b, e = info["data_offsets"]
        arr = np.frombuffer(data[base + b:base + e], dtype=st).reshape(info["shape"]).copy()
        out[name] = (arr, moe)
    return out


# ----------------------------------------------------------------------------
# Self-checks


def self_check():
    """Hand-computed cases and cross-checks of the rounding helpers. Raises
    AssertionError on a failure; returns the number of checks run."""
    import ml_dtypes
    n = 0
    # rounding against ml_dtypes / numpy on fp32-representable inputs (a single
    # rounding there, so both must agree bit for bit)
    rng = np.random.default_rng(1)
    v = np.concatenate([
        rng.standard_normal(20000).astype(np.float32),
        (rng.standard_normal(5000) * 1e-6).astype(np.float32),      # fp16 subnormals
        (rng.standard_normal(5000) * 1e-39).astype(np.float32),     # fp32/bf16 subnormals
        (rng.standard_normal(5000) * 7e4).astype(np.float32),       # fp16 overflow
        np.array([65504, 65519.996, 65520, -65520, 3.0e38, 3.4028235e38, 0.0, -0.0,
                  5.9604645e-08, 2.9802322e-08, 2.9802326e-08, 1.0 + 2**-8, 1.0 + 3 * 2**-8],
                 dtype=np.float32),
    ]).astype(np.float32)
    v64 = v.astype(np.float64)
    rb = round_to(v64, "bf16")
    eb = v.astype(ml_dtypes.bfloat16).astype(np.float64)
    assert np.array_equal(rb, eb, equal_nan=True), "bf16 rounding disagrees with ml_dtypes"
    rh = round_to(v64, "fp16")
    with np.errstate(over="ignore"):
        eh = v.astype(np.float16).astype(np.float64)
    assert np.array_equal(rh, eh, equal_nan=True), "fp16 rounding disagrees with numpy"
    assert np.array_equal(np.signbit(round_to(np.array([-0.0, -1e-30]), "fp16")), [True, True])
    n += 3
    # a single rounding from float64 (1 + 2^-8 + 2^-30 is above the tie)
    assert round_to(np.array([1 + 2**-8 + 2**-30]), "bf16")[0] == 1 + 2**-7
    assert round_to(np.array([1 + 2**-8]), "bf16")[0] == 1.0                 # tie -> even
    assert round_to(np.array([1 + 3 * 2**-8]), "bf16")[0] == 1 + 2**-6       # tie -> even (up)
    assert round_to(np.array([1 + 2**-11]), "fp16")[0] == 1.0
    assert round_to(np.array([2**-25]), "fp16")[0] == 0.0                    # tie to 0
    assert round_to(np.array([2**-25 + 2**-40]), "fp16")[0] == 2**-24        # smallest subnormal
    assert round_to(np.array([65520.0]), "fp16")[0] == np.inf
    assert round_to(np.array([65519.99]), "fp16")[0] == 65504.0
    n += 8
    # encode/decode round trip
    vals = round_to(rng.standard_normal(1000), "bf16")
    assert np.array_equal(decode(encode(vals, "bf16"), "bf16"), vals)
    vals = round_to(rng.standard_normal(1000), "fp16")
    assert np.array_equal(decode(encode(vals, "fp16"), "fp16"), vals)
    assert encode(np.array([1.0]), "bf16")[0] == 0x3F80 and encode(np.array([1.0]), "fp16")[0] == 0x3C00
    n += 3

    # topk, hand computed
    lg = np.array([[1.0, 3.0, 2.0, 3.0]])
    ids, w = topk_ref(lg, 2, "softmax")
    e = np.exp([1.0, 3.0, 2.0, 3.0])
    assert ids.tolist() == [[1, 3]]                      # tie -> lower index first
    assert np.allclose(w, [[e[1] / e.sum(), e[3] / e.sum()]], rtol=1e-15)
    ids, w = topk_ref(lg, 2, "softmax", renormalize=True, routed_scaling_factor=2.0)
    assert np.allclose(w, [[1.0, 1.0]], rtol=1e-15)
    ids, w = topk_ref(np.array([[0.0, 1.0, -1.0]]), 1, "sigmoid", correction_bias=[0.0, -1.0, 2.0])
    assert ids.tolist() == [[2]] and abs(w[0, 0] - 1 / (1 + math.e)) < 1e-15   # unbiased weight
    # grouping: 4 experts, 2 groups of 2; best group by max -> group 1 (max 0.9 vs 0.8)
    lg = np.array([[0.8, 0.7, 0.1, 0.9]])
    ids, _ = topk_ref(lg, 2, "sigmoid", num_expert_group=2, topk_group=1)
    assert ids.tolist() == [[3, 2]]
    # with a (zero) bias the group score is the sum of the top two: group 0 wins
    ids, _ = topk_ref(lg, 2, "sigmoid", num_expert_group=2, topk_group=1, correction_bias=[0.0] * 4)
    assert ids.tolist() == [[0, 1]]
    # equal groups -> lower group index
    ids, _ = topk_ref(np.array([[0.5, 0.2, 0.5, 0.2]]), 2, "sigmoid", num_expert_group=2, topk_group=1)
    assert ids.tolist() == [[0, 1]]
    n += 7

    # wna16 packing, hand written bytes
    q = unpack_int4_k(np.array([[[0x21, 0xF0]]], dtype=np.uint8))
    assert q.tolist() == [[[1, 2, 0, 15]]]
    z = unpack_int4_n(np.array([[[0x3A]]], dtype=np.uint8))
    assert z.tolist() == [[[10], [3]]]
    # w = act((q - z) * s): N=2, K=4, G=2, bits 4, zero points 10 (row 0) / 3 (row 1)
    qw = np.array([[[0x21, 0xF0], [0x54, 0x76]]], dtype=np.uint8)  # rows [1,2,0,15], [4,5,6,7]
    sc = np.array([[[0.5, 0.25], [1.0, 3.0]]])
    zp = np.array([[[0x3A, 0x3A]]], dtype=np.uint8)
    w = dequant_wna16(qw, sc, zp, 4, 2, 2, 4, "bf16")
    assert w.tolist() == [[[-4.5, -4.0, -2.5, 1.25], [1.0, 2.0, 9.0, 12.0]]], w.tolist()
    w = dequant_wna16(qw, sc[:, :, :1], None, 4, -1, 2, 4, "fp16")   # z = 8, one group per row
    assert w.tolist() == [[[-3.5, -3.0, -4.0, 3.5], [-4.0, -3.0, -2.0, -1.0]]]
    w = dequant_wna16(np.array([[[0, 255, 128, 129]]], dtype=np.uint8), np.array([[[1 / 3]]]), None, 8,
                      -1, 1, 4, "bf16")
    t3 = float(round_to(np.array([float(np.float32(1 / 3))]), "bf16")[0])
    assert w.tolist() == [[[float(round_to(np.array([float(np.float32(-128 * np.float32(1 / 3)))]), "bf16")[0]),
                            float(round_to(np.array([float(np.float32(127 * np.float32(1 / 3)))]), "bf16")[0]),
                            0.0, t3]]]
    n += 5

    # fused_moe, hand computed: H=2, I=1, E=1, x=[1, 2], W13=[[1,0],[0,1]]:
    # g=1, u=2; silu(1)=0.7310585786 -> bf16 0.73046875; a = 1.4609375 (exact);
    # W2 = [[1],[0.5]] -> [1.4609375, 0.73046875]; weight 1.
    x = np.array([[1.0, 2.0]])
    w13 = np.array([[[1.0, 0.0], [0.0, 1.0]]])
    w2 = np.array([[[1.0], [0.5]]])
    out = fused_moe_ref(x, np.array([[0]]), np.array([[1.0]]), w13, w2, "bf16", "silu")
    assert out.tolist() == [[1.4609375, 0.73046875]], out
    # fp16: silu(1) -> 0.7310546875 (1497/2048); a = 1.462109375 -> fp16 1.4619140625
    out = fused_moe_ref(x, np.array([[0]]), np.array([[1.0]]), w13, w2, "fp16", "silu")
    assert out.tolist() == [[1.4619140625, 0.73095703125]], out
    # weight 3 and two experts summed in fp32 then rounded once:
    # expert 0 gives y = act(1.4609375*0.3) etc.
    w13b = np.stack([w13[0], w13[0]])
    w2b = np.stack([w2[0], w2[0] * 2])
    out = fused_moe_ref(x, np.array([[1, 0]]), np.array([[0.3, 0.7]]), w13b, w2b, "bf16", "silu")
    y1 = round_to(np.array([1.4609375 * 2 * 0.3, 0.73046875 * 2 * 0.3]), "bf16")
    y0 = round_to(np.array([1.4609375 * 0.7, 0.73046875 * 0.7]), "bf16")
    assert out[0].tolist() == round_to(y1 + y0, "bf16").tolist()
    # shard: the expert held is global id 1; id 0 contributes nothing
    out = fused_moe_ref(x, np.array([[1, 0]]), np.array([[0.3, 0.7]]), w13b[1:], w2b[1:], "bf16", "silu",
                        expert_offset=1)
    assert out[0].tolist() == y1.tolist()
    # gelu(1) = 0.8413447461 -> bf16 0.83984375 (215/256); a = 1.6796875
    out = fused_moe_ref(x, np.array([[0]]), np.array([[1.0]]), w13, w2, "bf16", "gelu")
    assert out.tolist() == [[1.6796875, 0.83984375]], out
    # swiglu_oai, interleaved rows: gate row 0 -> g = 1, up row 1 -> u = 2
    # a = act(3 * 1 * sigmoid(1.702)) = act(2.537387..) = 2.53125 (162 * 2^-6)
    out = fused_moe_ref(x, np.array([[0]]), np.array([[1.0]]), w13, w2, "bf16", "swiglu_oai")
    a = 3.0 / (1.0 + math.exp(-1.702))
    assert out.tolist() == [[float(round_to(np.array([a]), "bf16")[0]),
                             float(round_to(np.array([float(round_to(np.array([a]), "bf16")[0]) * 0.5]),
                                            "bf16")[0])]], out
    assert float(round_to(np.array([a]), "bf16")[0]) == 2.53125
    # swiglu_oai clamps: g = 9 -> 7, u = -8 -> -7: a = -6 * 7 * sigmoid(11.914)
    x2 = np.array([[9.0, -8.0]])
    out = fused_moe_ref(x2, np.array([[0]]), np.array([[1.0]]), w13, w2, "bf16", "swiglu_oai")
    a = float(round_to(np.array([-6.0 * 7.0 / (1.0 + math.exp(-1.702 * 7.0))]), "bf16")[0])
    assert out[0, 0] == a and a == -42.0
    n += 8
    return n


if __name__ == "__main__":
    print(f"moe_reference self-check: {self_check()} checks passed")
