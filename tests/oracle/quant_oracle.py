"""Independent numpy oracle of moed's quantization ops, written from
docs/numerics.md alone (not from the C kernels).

Everything works on numpy arrays in *storage* form, as moelib passes them:
fp32 as float32, fp16/bf16 as uint16 bit patterns, fp8/fp4/e8m0 as uint8
codes (fp4: one code per uint8 here, `pack_fp4` packs two per byte), int8 as
int8.

Narrow-format conversion is done twice, by two independent routes:
  * `cvt_codes` (the oracle proper): exact float64 grid arithmetic
    (frexp/ldexp/rint) on the magnitude clipped to max finite, then a lookup
    of the code in a table built by decoding every code with our own
    bit-level decoder (`decode_codes`) from docs/numerics.md's format table.
  * `cvt_codes_ml` (cross-check): ml_dtypes' own RNE cast, with the contract
    laid on top (clip before the cast since ml_dtypes turns out-of-range into
    NaN; NaN -> the format's NaN code; e4m3fnuz has no -0).
`self_check()` asserts that both routes agree, that our decoder agrees with
ml_dtypes' and checks the hand-picked cases quoted in docs/numerics.md.
"""
import ml_dtypes
import numpy as np

F32 = np.float32

# ---------------------------------------------------------------- formats
# name: (exponent bits, mantissa bits, bias, max finite, NaN code, ml_dtypes type)
FORMATS = {
    "fp8_e4m3fn": (4, 3, 7, 448.0, 0x7F, ml_dtypes.float8_e4m3fn),
    "fp8_e4m3fnuz": (4, 3, 8, 240.0, 0x80, ml_dtypes.float8_e4m3fnuz),
    "fp8_e5m2": (5, 2, 15, 57344.0, 0x7F, ml_dtypes.float8_e5m2),
    "fp4_e2m1": (2, 1, 1, 6.0, None, ml_dtypes.float4_e2m1fn),
}
DTYPE_MAX = {"fp8_e4m3fn": 448.0, "fp8_e4m3fnuz": 240.0, "int8": 127.0}
MX_FORMATS = {  # format param -> (element format, emax, dtype_max for amax_up/down)
    "mxfp4": ("fp4_e2m1", 2, 6.0),
    "mxfp8_e4m3fn": ("fp8_e4m3fn", 8, 448.0),
    "mxfp8_e5m2": ("fp8_e5m2", 15, 57344.0),
}


def _sign_bit(fmt):
    return 0x8 if fmt == "fp4_e2m1" else 0x80


def decode_codes(codes, fmt):
    """Value (float64) of each code, from the format table of docs/numerics.md:
    bias/exponent/mantissa, subnormals at e == 0, specials per format
    (e4m3fn: 0x7F/0xFF NaN, no inf; e4m3fnuz: 0x80 NaN, no -0, no inf;
    e5m2: IEEE-like, exponent 31 = inf (m == 0) / NaN; fp4: no specials)."""
    ebits, mbits, bias, _, _, _ = FORMATS[fmt]
    c = np.asarray(codes).astype(np.int64)
    nbits = 1 + ebits + mbits
    sign = (c >> (nbits - 1)) & 1
    e = (c >> mbits) & ((1 << ebits) - 1)
    m = c & ((1 << mbits) - 1)
    mag = np.where(e == 0, np.ldexp(m.astype(np.float64), 1 - bias - mbits),
                   np.ldexp((m + (1 << mbits)).astype(np.float64), e - bias - mbits))
    val = np.where(sign == 1, -mag, mag)
    if fmt == "fp8_e4m3fn":
        val = np.where((c & 0x7F) == 0x7F, np.nan, val)
    elif fmt == "fp8_e4m3fnuz":
        val = np.where(c == 0x80, np.nan, val)
    elif fmt == "fp8_e5m2":
        top = e == 31
        val = np.where(top & (m == 0), np.where(sign == 1, -np.inf, np.inf), val)
        val = np.where(top & (m != 0), np.nan, val)
    return val


def decode_e8m0(b):
    """e8m0 byte b -> 2^(b-127) (float64); 0xFF -> NaN."""
    b = np.asarray(b).astype(np.int64)
    return np.where(b == 0xFF, np.nan, np.ldexp(1.0, b - 127))


def _pos_table(fmt):
    """Sorted non-negative finite grid values and their codes."""
    ebits, mbits, _, maxv, _, _ = FORMATS[fmt]
    ncodes = 1 << (1 + ebits + mbits)
    codes = np.arange(ncodes // 2)
    vals = decode_codes(codes, fmt)
    keep = np.isfinite(vals) & (vals <= maxv)
    vals, codes = vals[keep], codes[keep]
    assert np.all(np.diff(vals) > 0), fmt
    assert vals[-1] == maxv, fmt
    return vals, codes


_TABLES = {}


def _table(fmt):
    if fmt not in _TABLES:
        _TABLES[fmt] = _pos_table(fmt)
    return _TABLES[fmt]


def round_grid(a, fmt, half_up=False):
    """a: float64 magnitudes, finite, 0 <= a <= max finite. Round to the
    format's grid (subnormals included): ties to even, or away from zero with
    half_up. Exact float64 arithmetic (scalings by powers of two)."""
    _, mbits, bias, _, _, _ = FORMATS[fmt]
    emin = 1 - bias
    _, e = np.frexp(a)                      # a = f * 2^e, f in [0.5, 1)
    ex = np.maximum(e - 1, emin)            # binade exponent (subnormals: emin)
    q = np.ldexp(a, mbits - ex)             # a / ulp, exact
    q = np.floor(q + 0.5) if half_up else np.rint(q)
    return np.ldexp(q, ex - mbits)


def cvt_codes(v, fmt, half_up=False):
    """fp32 values -> codes (uint8) per docs/numerics.md: RNE (or half_up) to the
    grid, saturate to +-max finite (inf too), NaN -> NaN code, sign kept
    (-0 kept) except e4m3fnuz where every zero is 0x00."""
    v = np.asarray(v, dtype=F32)
    _, _, _, maxv, nan_code, _ = FORMATS[fmt]
    nan = np.isnan(v)
    with np.errstate(invalid="ignore"):
        a = np.abs(v.astype(np.float64))
    a = np.where(nan, 0.0, np.minimum(a, maxv))
    g = round_grid(a, fmt, half_up)
    vals, codes = _table(fmt)
    idx = np.searchsorted(vals, g)
    assert np.all(vals[np.minimum(idx, len(vals) - 1)] == g), "grid value not a code"
    mag = codes[idx].astype(np.int64)
    neg = np.signbit(v)
    if fmt == "fp8_e4m3fnuz":
        neg = neg & (mag != 0)
    out = np.where(neg, mag | _sign_bit(fmt), mag)
    if nan_code is not None:
        out = np.where(nan, nan_code, out)
    else:
        assert not nan.any(), "fp4 has no NaN"
    return out.astype(np.uint8)


def cvt_codes_ml(v, fmt):
    """Second route (RNE only): ml_dtypes' cast with the contract laid on top."""
    v = np.asarray(v, dtype=F32)
    _, _, _, maxv, nan_code, mlt = FORMATS[fmt]
    nan = np.isnan(v)
    a = np.where(nan, F32(0), np.minimum(np.abs(v), F32(maxv))).astype(F32)
    mag = a.astype(mlt).view(np.uint8).astype(np.int64)
    neg = np.signbit(v)
    if fmt == "fp8_e4m3fnuz":
        neg = neg & (mag != 0)
    out = np.where(neg, mag | _sign_bit(fmt), mag)
    if nan_code is not None:
        out = np.where(nan, nan_code, out)
    return out.astype(np.uint8)


def cvt_int8(v):
    """fp32 -> int8: RNE, saturate to [-128, 127] (inf too), NaN -> 0."""
    v = np.asarray(v, dtype=F32).astype(np.float64)
    r = np.rint(np.where(np.isnan(v), 0.0, np.clip(v, -128.0, 127.0)))
    return r.astype(np.int8)


def cvt(v, out_dtype, half_up=False):
    if out_dtype == "int8":
        assert not half_up
        return cvt_int8(v)
    return cvt_codes(v, out_dtype, half_up)


# ------------------------------------------------------- 16-bit float storage
def widen(arr, dtype):
    """Storage array -> fp32 (exact)."""
    if dtype == "fp32":
        return np.asarray(arr, dtype=F32)
    if dtype == "fp16":
        return np.asarray(arr, dtype=np.uint16).view(np.float16).astype(F32)
    if dtype == "bf16":
        return (np.asarray(arr, dtype=np.uint16).astype(np.uint32) << 16).view(F32)
    raise ValueError(dtype)


def f32_to_bf16(v):
    """RNE on the bits; overflow -> inf (falls out of the carry); NaN -> 0x7FC0."""
    v = np.asarray(v, dtype=F32)
    b = v.view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(v), np.uint16(0x7FC0), r).astype(np.uint16)


def f32_to_fp16(v):
    """RNE (numpy's conversion: correctly rounded, subnormals, overflow -> inf);
    NaN -> 0x7E00."""
    v = np.asarray(v, dtype=F32)
    with np.errstate(over="ignore", invalid="ignore"):
        r = v.astype(np.float16).view(np.uint16)
    return np.where(np.isnan(v), np.uint16(0x7E00), r).astype(np.uint16)


def narrow(v, out_dtype):
    """fp32 -> storage of out_dtype (fp32 kept as is)."""
    if out_dtype == "fp32":
        return np.asarray(v, dtype=F32)
    if out_dtype == "fp16":
        return f32_to_fp16(v)
    if out_dtype == "bf16":
        return f32_to_bf16(v)
    raise ValueError(out_dtype)


# ------------------------------------------------------------------- helpers
def _amax_finite(x, axis=None, keepdims=False):
    a = np.abs(x)
    return np.max(np.where(np.isfinite(x), a, F32(0)), axis=axis, keepdims=keepdims,
                  initial=F32(0)).astype(F32)


def _apply_scale(x, s, exact):
    """x * (1/s) (fast) or x / s (exact), fp32, s broadcastable."""
    with np.errstate(all="ignore"):
        s = np.asarray(s, dtype=F32)
        if exact:
            return (x / s).astype(F32)
        r = (F32(1.0) / s).astype(F32)
        return (x * r).astype(F32)


def bits32(v):
    return np.asarray(v, dtype=F32).view(np.uint32)


def from_bits32(b):
    return np.asarray(b, dtype=np.uint32).view(F32)


# ------------------------------------------------------------------------ ops
def quant_per_tensor(x, out_dtype, scale=None, exact_division=False):
    """x fp32 (any shape). Returns (q, scale fp32 [1])."""
    x = np.asarray(x, dtype=F32)
    if scale is None:
        with np.errstate(all="ignore"):
            s = F32(_amax_finite(x) / F32(DTYPE_MAX[out_dtype]))
        if s == 0:
            s = F32(1.0)
    else:
        s = F32(scale)
        if not (np.isfinite(s) and s > 0):
            raise ValueError("scale must be finite and > 0")
    q = cvt(_apply_scale(x, s, exact_division), out_dtype)
    return q.reshape(x.shape), np.array([s], dtype=F32)


def quant_per_token(x, out_dtype, scale_ub=None, exact_division=False):
    """x fp32 [.., K]. Returns (q, scales fp32 [rows, 1]). exact_division is
    not in docs/design.md's table for per_token; docs/numerics.md makes per_token "the
    same as dynamic per-tensor", which has it (default false)."""
    x = np.asarray(x, dtype=F32)
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    amax = _amax_finite(x2, axis=1, keepdims=True)
    if scale_ub is not None:
        amax = np.minimum(amax, F32(scale_ub)).astype(F32)
    with np.errstate(all="ignore"):
        s = (amax / F32(DTYPE_MAX[out_dtype])).astype(F32)
    s = np.where(s == 0, F32(1.0), s).astype(F32)
    q = cvt(_apply_scale(x2, s, exact_division), out_dtype)
    return q.reshape(x.shape), s


def quant_per_token_group(x, out_dtype, group_size=128, scale_rule=None, exact_division=False):
    """x fp32 [.., K], G = group_size dividing K. Returns (q, scales fp32
    [.., K / G]): per group of G consecutive elements of a row, dynamic
    per-tensor over that group; scale_rule "pow2_up" first rounds each s up
    to a power of two through its bits."""
    x = np.asarray(x, dtype=F32)
    K = x.shape[-1]
    if group_size < 1 or K % group_size:
        raise ValueError("group_size must divide K")
    xg = x.reshape(-1, group_size)
    amax = _amax_finite(xg, axis=1, keepdims=True)
    with np.errstate(all="ignore"):
        s = (amax / F32(DTYPE_MAX[out_dtype])).astype(F32)
    s = np.where(s == 0, F32(1.0), s).astype(F32)
    if scale_rule == "pow2_up":
        b = bits32(s).astype(np.uint64)
        s = from_bits32(((b + 0x7FFFFF) & 0x7F800000).astype(np.uint32)).astype(F32)
    q = cvt(_apply_scale(xg, s, exact_division), out_dtype)
    return q.reshape(x.shape), s.reshape(x.shape[:-1] + (K // group_size,))


def _mx_scale(amax, fmt, rule):
    """amax: fp32 [..] (finite, >= 0). Returns (scale byte, fp32 multiplier m)
    so that elements are cvt(x * m)."""
    elem, emax, dmax = MX_FORMATS[fmt]
    if rule in ("even", "floor"):
        b = bits32(amax).astype(np.int64)
        if rule == "even":
            b = b + 0x200000
        r = b & 0xFF800000
        e = (r >> 23) & 0xFF
        unb = np.where(e == 0, -127, np.where(e == 255, 127, e - 127 - emax))
        unb = np.clip(unb, -127, 127)
        byte = (unb + 127).astype(np.uint8)
        m = np.ldexp(F32(1.0), -unb).astype(F32)          # 2^-unb, exact in fp32
        return byte, m
    if rule in ("amax_up", "amax_down"):
        with np.errstate(all="ignore"):
            d = (amax / F32(dmax)).astype(F32)
        b = bits32(d).astype(np.int64)
        if rule == "amax_up":
            b = b + 0x7FFFFF
        x_e = b & 0x7F800000
        byte = (x_e >> 23).astype(np.uint8)
        with np.errstate(all="ignore"):
            m = np.where(x_e == 0, F32(0.0),
                         F32(1.0) / from_bits32(x_e.astype(np.uint32))).astype(F32)
        return byte, m
    raise ValueError(rule)


def quant_mx(x, fmt, scale_rule="even", element_rounding="rne"):
    """x fp32 [.., K], K % 32 == 0. Returns (q, scales): q uint8 codes
    [.., K] for fp8 or packed [.., K/2] for fp4; scales uint8 [.., K/32]."""
    x = np.asarray(x, dtype=F32)
    K = x.shape[-1]
    assert K % 32 == 0
    elem, _, _ = MX_FORMATS[fmt]
    half_up = element_rounding == "half_up"
    assert not half_up or elem == "fp4_e2m1"
    blk = x.reshape(-1, 32)
    bad = ~np.all(np.isfinite(blk), axis=1)
    amax = np.max(np.abs(np.where(bad[:, None], F32(0), blk)), axis=1).astype(F32)
    byte, m = _mx_scale(amax, fmt, scale_rule)
    with np.errstate(all="ignore"):
        y = (np.where(bad[:, None], F32(0), blk) * m[:, None]).astype(F32)
    codes = cvt_codes(y, elem, half_up)
    codes = np.where(bad[:, None], np.uint8(0), codes).astype(np.uint8)
    byte = np.where(bad, np.uint8(0xFF), byte).astype(np.uint8)
    codes = codes.reshape(x.shape)
    if elem == "fp4_e2m1":
        codes = pack_fp4(codes)
    return codes, byte.reshape(x.shape[:-1] + (K // 32,))


def pack_fp4(codes):
    c = np.asarray(codes, dtype=np.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)


def unpack_fp4(packed):
    p = np.asarray(packed, dtype=np.uint8)
    out = np.empty(p.shape[:-1] + (p.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = p & 0xF
    out[..., 1::2] = p >> 4
    return out


def dequant_per_tensor(q, scale, in_dtype, out_dtype):
    """y = float(q) * s (fp32), rounded to out_dtype."""
    s = F32(scale)
    if not (np.isfinite(s) and s > 0):
        raise ValueError("scale must be finite and > 0")
    if in_dtype == "int8":
        v = np.asarray(q).astype(np.int8).astype(F32)
    else:
        v = decode_codes(np.asarray(q).astype(np.uint8), in_dtype).astype(F32)
    with np.errstate(all="ignore"):
        y = (v * s).astype(F32)
    return narrow(y, out_dtype)


def dequant_mx(q, scales, fmt, out_dtype):
    """q: uint8 codes [.., K] (fp8) or packed [.., K/2] (fp4); scales uint8
    [.., K/32]. y = value(code) * 2^(b-127) in fp32, b = 0xFF -> NaN."""
    elem, _, _ = MX_FORMATS[fmt]
    codes = unpack_fp4(q) if elem == "fp4_e2m1" else np.asarray(q, dtype=np.uint8)
    K = codes.shape[-1]
    v = decode_codes(codes, elem).astype(F32).reshape(-1, 32)
    sc = decode_e8m0(np.asarray(scales, dtype=np.uint8).reshape(-1)).astype(F32)
    with np.errstate(all="ignore"):
        y = (v * sc[:, None]).astype(F32)
    return narrow(y.reshape(codes.shape[:-1] + (K,)), out_dtype)


# ---------------------------------------------------------------- self check
def self_check(verbose=False):
    """Checks the oracle itself. Returns the number of checked facts."""
    n = 0

    def eq(a, b, what):
        nonlocal n
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and np.array_equal(a, b), f"self-check {what}: {a} != {b}"
        n += a.size

    # Decoders against ml_dtypes (bit-level decode vs library decode).
    for fmt, (ebits, mbits, _, _, _, mlt) in FORMATS.items():
        nc = 1 << (1 + ebits + mbits)
        mine = decode_codes(np.arange(nc), fmt)
        theirs = np.arange(nc, dtype=np.uint8).view(mlt).astype(np.float64)
        assert np.array_equal(np.isnan(mine), np.isnan(theirs)), fmt
        ok = ~np.isnan(mine)
        eq(mine[ok], theirs[ok], f"decode {fmt}")
        eq(np.signbit(mine[ok]), np.signbit(theirs[ok]), f"decode sign {fmt}")
    e8 = np.arange(256, dtype=np.uint8)
    mine, theirs = decode_e8m0(e8), e8.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    assert np.array_equal(np.isnan(mine), np.isnan(theirs))
    eq(mine[:255], theirs[:255], "decode e8m0")
    eq(mine[[0, 127, 254]], [2.0 ** -127, 1.0, 2.0 ** 127], "e8m0 table")
    # Table of docs/numerics.md.
    eq(decode_codes([0x7E], "fp8_e4m3fn"), [448.0], "e4m3fn max")
    eq(decode_codes([0x7F], "fp8_e4m3fnuz"), [240.0], "e4m3fnuz max")
    eq(decode_codes([0x7B], "fp8_e5m2"), [57344.0], "e5m2 max")
    eq(decode_codes(np.arange(8), "fp4_e2m1"), [0, .5, 1, 1.5, 2, 3, 4, 6], "fp4 values")

    # Hand-picked conversions from docs/numerics.md.
    fp4 = lambda vals, hu=False: cvt_codes(np.array(vals, F32), "fp4_e2m1", hu)  # noqa: E731
    eq(fp4([0.25, 0.75, 1.25, 2.5, 5.0]), [0, 2, 2, 4, 6], "fp4 ties RNE")   # 0,1.0,1.0,2,4
    eq(fp4([-0.25, -0.75, -1.25, -2.5, -5.0]), [8, 10, 10, 12, 14], "fp4 -ties")
    eq(fp4([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], True), [1, 2, 3, 4, 5, 6, 7], "fp4 half_up")
    eq(fp4([6.0, 7.0, 1e30, np.inf, -np.inf, -0.0, 0.0, -1e-30]), [7, 7, 7, 7, 15, 8, 0, 8], "fp4 sat")
    eq(fp4([0.2499999, 0.2500001, 5.0000005, 4.9999995]), [0, 1, 7, 6], "fp4 near ties")
    e4 = lambda vals, f="fp8_e4m3fn": cvt_codes(np.array(vals, F32), f)  # noqa: E731
    eq(e4([464.0, 470.0, 480.0, 1e9, np.inf, -np.inf, -464.0]), [0x7E] * 5 + [0xFE, 0xFE], "e4m3fn sat")
    eq(e4([np.nan, -np.nan, -0.0, 0.0]), [0x7F, 0x7F, 0x80, 0x00], "e4m3fn nan/-0")
    eq(e4([2.0 ** -9, 2.0 ** -10, 2.0 ** -10 * 1.0000001, 3 * 2.0 ** -10, -(2.0 ** -10)]),
       [1, 0, 1, 2, 0x80], "e4m3fn subnormal ties")
    eq(e4([240.0, 248.0, 1e9, -np.inf, np.nan, -np.nan, -0.0, -1e-20], "fp8_e4m3fnuz"),
       [0x7F, 0x7F, 0x7F, 0xFF, 0x80, 0x80, 0x00, 0x00], "e4m3fnuz")
    eq(e4([57344.0, 61440.0, 1e9, np.inf, -np.inf, np.nan, -0.0], "fp8_e5m2"),
       [0x7B, 0x7B, 0x7B, 0x7B, 0xFB, 0x7F, 0x80], "e5m2 sat")
    eq(cvt_int8(np.array([0.5, 1.5, 2.5, -0.5, -2.5, 126.5, 127.5, 1e9, -1e9, -128.5, np.nan,
                          np.inf, -np.inf], F32)),
       np.array([0, 2, 2, 0, -2, 126, 127, 127, -128, -128, 0, 127, -128], np.int8), "int8")

    # fp16 / bf16 narrowing.
    eq(f32_to_bf16(np.array([1.0, np.nan, -np.nan, 3.4e38, np.inf], F32)),
       np.array([0x3F80, 0x7FC0, 0x7FC0, 0x7F80, 0x7F80], np.uint16), "bf16")
    eq(f32_to_bf16(from_bits32(np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x00008000], np.uint32))),
       np.array([0x3F80, 0x3F82, 0x3F81, 0x0000], np.uint16), "bf16 ties")
    eq(f32_to_fp16(np.array([65520.0, 65519.0, np.nan, -np.nan, 2.0 ** -25, 2.0 ** -24 * 1.5], F32)),
       np.array([0x7C00, 0x7BFF, 0x7E00, 0x7E00, 0x0000, 0x0002], np.uint16), "fp16")

    # Both conversion routes agree on a dense sweep of fp32 bit patterns
    # (every 2^k-th pattern plus everything around each format's grid and ties).
    rng = np.random.default_rng(1234)
    pats = [np.arange(0, 1 << 32, 997, dtype=np.uint64).astype(np.uint32)]
    for fmt in FORMATS:
        vals, _ = _table(fmt)
        mids = np.concatenate([vals, (vals[:-1] + vals[1:]) / 2, [vals[-1] * 1.0625, vals[-1] * 1.125]])
        b = bits32(mids.astype(F32)).astype(np.int64)
        near = (b[:, None] + np.arange(-3, 4)[None, :]).ravel()
        near = near[(near >= 0) & (near < 1 << 31)].astype(np.uint32)
        pats += [near, near | np.uint32(0x80000000)]
    pats.append(rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32))
    sweep = from_bits32(np.concatenate(pats))
    for fmt in FORMATS:
        v = sweep if fmt != "fp4_e2m1" else sweep[~np.isnan(sweep)]
        eq(cvt_codes(v, fmt), cvt_codes_ml(v, fmt), f"routes {fmt}")
    # half_up: differs from RNE only at exact ties, and there it rounds away.
    v = sweep[~np.isnan(sweep)]
    a, b = cvt_codes(v, "fp4_e2m1", True), cvt_codes(v, "fp4_e2m1")
    diff = a != b
    av = np.abs(v[diff].astype(np.float64))
    vals, _ = _table("fp4_e2m1")
    assert np.all(np.isin(av, (vals[:-1] + vals[1:]) / 2)), "half_up differs off a tie"
    assert np.all((a[diff] & 7) == (b[diff] & 7) + 1), "half_up not away from zero"
    # int8 against a plain formula on integers +- 0.5.
    t = np.arange(-140, 140, 0.25, dtype=F32)
    ref = np.clip(np.round(t.astype(np.float64)), -128, 127).astype(np.int8)  # np.round is RNE
    eq(cvt_int8(t), ref, "int8 sweep")

    # Ops on a few hand-made examples.
    q, s = quant_per_tensor(np.array([448.0, 1.0, 0.0, -np.inf], F32), "fp8_e4m3fn")
    eq(s, np.array([1.0], F32), "dyn scale")
    eq(q, np.array([0x7E, 0x38, 0x00, 0xFE], np.uint8), "dyn q")
    q, s = quant_per_tensor(np.array([0.0, 1.0, -0.0], F32), "fp8_e4m3fn", scale=1e-40)
    eq(q, np.array([0x7F, 0x7E, 0x7F], np.uint8), "tiny scale: 0*inf -> NaN code")
    q, s = quant_per_tensor(np.array([0.0, 1.0], F32), "int8", scale=1e-40)
    eq(q, np.array([0, 127], np.int8), "tiny scale int8")
    q, s = quant_mx(np.full((1, 32), 6.0, F32), "mxfp4")
    # 6.0: bits 0x40C00000 + 0x200000 -> 0x40E00000 & mask -> 0x40800000 (e = 129) ->
    # unb = 129 - 127 - 2 = 0 -> byte 127, elements 6 -> code 7.
    eq(s, np.array([[127]], np.uint8), "mx even 6")
    eq(q, np.full((1, 16), 0x77, np.uint8), "mx even 6 q")
    # 7.0: 0x40E00000 + 0x200000 = 0x41000000 -> e = 130 -> unb 1 -> 3.5 -> 4 (code 6).
    q, s = quant_mx(np.full((1, 32), 7.0, F32), "mxfp4")
    eq(s, np.array([[128]], np.uint8), "mx even 7")
    eq(q, np.full((1, 16), 0x66, np.uint8), "mx even 7 q")
    q, s = quant_mx(np.full((1, 32), 7.0, F32), "mxfp4", "floor")
    eq(s, np.array([[127]], np.uint8), "mx floor 7")
    eq(q, np.full((1, 16), 0x77, np.uint8), "mx floor 7 q (saturated)")
    x = np.zeros((1, 64), F32)
    x[0, 3] = np.nan
    x[0, 40] = 1.0
    q, s = quant_mx(x, "mxfp8_e4m3fn")
    eq(s, np.array([[0xFF, 127 - 8]], np.uint8), "mx nan block")
    eq(q[0, :32], np.zeros(32, np.uint8), "mx nan block q")
    eq(q[0, 40], np.uint8(0x38 + (8 << 3)), "mx 1.0 * 2^8 = 256")
    q, s = quant_mx(np.zeros((1, 32), F32), "mxfp4")
    eq(s, np.array([[0]], np.uint8), "mx zeros")
    q, s = quant_mx(np.full((1, 32), 3.4e38, F32), "mxfp4")
    eq(s, np.array([[254]], np.uint8), "mx even huge (bump into inf: unb 127)")
    # amax_up: amax 7 -> d = 7/6 -> up -> 2 -> byte 128, m = 0.5 -> 3.5 -> 4
    q, s = quant_mx(np.full((1, 32), 7.0, F32), "mxfp4", "amax_up")
    eq(s, np.array([[128]], np.uint8), "mx amax_up 7")
    eq(q, np.full((1, 16), 0x66, np.uint8), "mx amax_up 7 q")
    q, s = quant_mx(np.full((1, 32), 7.0, F32), "mxfp4", "amax_down")
    eq(s, np.array([[127]], np.uint8), "mx amax_down 7")
    q, s = quant_mx(np.full((1, 32), 1e-45, F32), "mxfp4", "amax_down")
    eq(s, np.array([[0]], np.uint8), "mx amax_down subnormal d -> byte 0")
    eq(q, np.zeros((1, 16), np.uint8), "mx amax_down subnormal d -> m = 0")
    y = dequant_mx(np.array([[0x72] * 16], np.uint8), np.array([[128]], np.uint8), "mxfp4", "fp32")
    eq(y, np.array([[2.0, 12.0] * 16], F32), "dequant mx fp4")
    y = dequant_per_tensor(np.array([0x7F, 0x7E, 0x80], np.uint8), 2.0, "fp8_e4m3fn", "bf16")
    eq(y, np.array([0x7FC0, 0x4460, 0x8000], np.uint16), "dequant per tensor")
    if verbose:
        print(f"quant oracle self-check: {n} facts")
    return n


if __name__ == "__main__":
    self_check(verbose=True)
