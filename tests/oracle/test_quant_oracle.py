"""Bit-exact check of libmoe's quantization ops against the independent numpy
oracle (quant_oracle.py, written from docs/numerics.md).

Run by ctest (MOE_LIB points at libmoe.so). Exit 0 when every output bit
matches; otherwise the first mismatches are printed with their inputs.
`--oracle-only` runs the whole harness against the oracle itself (checks the
harness and its runtime without the C library). `--quick` thins the scale
lists (for development)."""
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quant_oracle as Q  # noqa: E402

F32 = np.float32
ORACLE_ONLY = "--oracle-only" in sys.argv
QUICK = "--quick" in sys.argv
MAX_PRINT_PER_CASE = 6
MAX_PRINT_TOTAL = 60

if not ORACLE_ONLY:
    import moelib  # noqa: E402


# ------------------------------------------------------------- bookkeeping
class Stats:
    def __init__(self):
        self.passed = 0
        self.failed = 0
        self.elements = 0
        self.mismatches = 0
        self.printed = 0
        self.errors = 0
        self.by_group = {}

    def group(self, g):
        return self.by_group.setdefault(g, [0, 0, 0, 0])  # passed, failed, elements, mismatches


ST = Stats()


def fhex(v):
    v = np.asarray(v)
    if v.dtype == np.float32:
        return f"0x{int(v.view(np.uint32)):08x}({float(v)!r})"
    return f"0x{int(v.astype(np.int64)) & 0xFFFFFFFF:0{2 * v.dtype.itemsize}x}"


def xdesc(xs, xdtype, i):
    """Input element i in storage form + its value."""
    if xdtype == "fp32":
        return fhex(xs.reshape(-1)[i])
    b = int(xs.reshape(-1)[i])
    return f"{xdtype} 0x{b:04x}({float(Q.widen(np.array([b], np.uint16), xdtype)[0])!r})"


def emit(line):
    if ST.printed < MAX_PRINT_TOTAL:
        print(line, flush=True)
    ST.printed += 1


def compare(group, case, got, expected, ctx=None, nan_any=False):
    """Compare one output bit for bit. got/expected: numpy storage arrays.
    nan_any: fp32 outputs whose NaN bits the contract leaves open: any NaN
    matches any NaN. Returns True when equal."""
    g = ST.group(group)
    if got.shape != expected.shape:
        emit(f"MISMATCH {case}: shape {got.shape} != expected {expected.shape}")
        g[3] += 1
        ST.mismatches += 1
        return False
    if got.dtype.itemsize != expected.dtype.itemsize:
        emit(f"MISMATCH {case}: element size {got.dtype} != expected {expected.dtype}")
        g[3] += 1
        ST.mismatches += 1
        return False
    ut = {1: np.uint8, 2: np.uint16, 4: np.uint32}[expected.dtype.itemsize]
    gb = np.ascontiguousarray(got).view(ut).reshape(-1)
    eb = np.ascontiguousarray(expected).view(ut).reshape(-1)
    bad = gb != eb
    if nan_any and expected.dtype == np.float32:
        bad &= ~(np.isnan(got.reshape(-1)) & np.isnan(expected.reshape(-1)))
    n = int(bad.sum())
    g[2] += gb.size
    g[3] += n
    ST.elements += gb.size
    ST.mismatches += n
    if n:
        idx = np.nonzero(bad)[0]
        emit(f"MISMATCH {case}: {n} of {gb.size} elements differ")
        for i in idx[:MAX_PRINT_PER_CASE]:
            c = ctx(int(i)) if ctx else ""
            emit(f"    [{i}] {c} expected {fhex(expected.reshape(-1)[i])} got {fhex(got.reshape(-1)[i])}")
    return n == 0


def case_done(group, ok):
    g = ST.group(group)
    if ok:
        ST.passed += 1
        g[0] += 1
    else:
        ST.failed += 1
        g[1] += 1


def check_dtype(case, got_name, allowed):
    if got_name not in allowed:
        emit(f"MISMATCH {case}: output dtype {got_name} not in {allowed}")
        ST.mismatches += 1
        return False
    return True


# ------------------------------------------------------------ the op calls
def run_op(op, inputs, params):
    """Run op in libmoe (or, with --oracle-only, in the oracle itself)."""
    if not ORACLE_ONLY:
        return moelib.run(op, inputs, params)
    return fake_run(op, inputs, params)


def fake_run(op, inputs, params):
    """The oracle dressed as moelib.run (for --oracle-only)."""
    def x32(name):
        a, dt = inputs[name][0], inputs[name][1]
        return Q.widen(a, dt)
    if op == "quant.per_tensor":
        od = params["out_dtype"]
        sc = float(inputs["scale"][0][0]) if "scale" in inputs else None
        q, s = Q.quant_per_tensor(x32("x"), od, sc, params.get("exact_division", False))
        return {"q": (q, od), "scale": (s, "fp32")}
    if op == "quant.per_token":
        od = params["out_dtype"]
        q, s = Q.quant_per_token(x32("x"), od, params.get("scale_ub"), params.get("exact_division", False))
        return {"q": (q, od), "scales": (s, "fp32")}
    if op == "quant.per_token_group":
        od = params.get("out_dtype", "fp8_e4m3fn")
        q, s = Q.quant_per_token_group(x32("x"), od, params.get("group_size", 128), params.get("scale_rule"),
                                       params.get("exact_division", False))
        return {"q": (q, od), "scales": (s, "fp32")}
    if op == "quant.mx":
        fmt = params["format"]
        q, s = Q.quant_mx(x32("x"), fmt, params.get("scale_rule", "even"),
                          params.get("element_rounding", "rne"))
        return {"q": (q, Q.MX_FORMATS[fmt][0]), "scales": (s, "e8m0")}
    if op == "dequant.per_tensor":
        y = Q.dequant_per_tensor(inputs["q"][0], float(inputs["scale"][0][0]), params["in_dtype"],
                                 params["out_dtype"])
        return {"y": (y, params["out_dtype"])}
    if op == "dequant.mx":
        y = Q.dequant_mx(inputs["q"][0], inputs["scales"][0], params["format"], params["out_dtype"])
        return {"y": (y, params["out_dtype"])}
    raise ValueError(op)


def call(group, case, op, inputs, params):
    """Returns outputs dict or None (error counted as a failed case)."""
    try:
        return run_op(op, inputs, params)
    except Exception as e:  # noqa: BLE001
        ST.errors += 1
        emit(f"ERROR {case}: {e!r}")
        case_done(group, False)
        return None


# ------------------------------------------------------------ input sets
ALL16 = np.arange(65536, dtype=np.uint32).astype(np.uint16)


def finite16(dtype):
    return ALL16[np.isfinite(Q.widen(ALL16, dtype))]


def static_scales():
    """>= 300 fp32 scales: log-spaced 2^-20..2^20 (eighths of an octave, so
    exact powers of two included) plus odd values and tiny ones whose
    reciprocal overflows to inf."""
    s = [float(F32(2.0 ** (k / 8))) for k in range(-160, 161)]
    s += [0.1, 1 / 3, 448 / 240, 240 / 448, 1e-3, 1e-40, 1e-45, 2.0 ** -126, 2.0 ** -127, 3e-39,
          2.0 ** -128 * 1.5, 1e-38, 3.4028234663852886e38, 1e30, 1e20, 7.0, 0.7, 1 / 448, 1 / 240,
          1 / 127, 65504 / 448, 65504 / 127, 1.0000001, 0.99999994, 0.3, 5.0, 1e-7, 123.456,
          448.0, 127.0, 57344.0, 2.0 ** 64, 2.0 ** -64, 2.0 ** 100, 2.0 ** -100, 6e-8, 1 / 1.5]
    rng = np.random.default_rng(7)
    s += list(np.exp(rng.uniform(-30, 30, 16)).astype(F32).astype(float))
    out = sorted(set(float(F32(v)) for v in s))
    if QUICK:
        out = out[::10]
    return out


def double_rounding_scales(n=24):
    """Scales for dequant.per_tensor at which the contract's fp32 product
    (float(q) * s, rounded to fp32, then to fp16/bf16) differs from rounding
    the exact product once: they tell the two readings apart."""
    rng = np.random.default_rng(17)
    pool = Q.from_bits32(rng.integers(0x30000000, 0x4F000000, 8192, dtype=np.uint64).astype(np.uint32))
    vals = np.concatenate([np.arange(-128, 128, dtype=np.float64),
                           Q.decode_codes(np.arange(256), "fp8_e4m3fn"),
                           Q.decode_codes(np.arange(256), "fp8_e4m3fnuz")])
    vals = vals[np.isfinite(vals) & (vals != 0)]
    exact = vals[None, :] * pool.astype(np.float64)[:, None]        # exact (<= 32 significant bits)
    f32 = (vals.astype(F32)[None, :] * pool[:, None]).astype(F32)
    m, e = np.frexp(exact)
    bf_once = np.ldexp(np.rint(np.ldexp(m, 8)), e - 8)                # one RNE to 8 bits
    m, e = np.frexp(f32.astype(np.float64))
    bf_twice = np.ldexp(np.rint(np.ldexp(m, 8)), e - 8)
    fp_once = exact.astype(np.float16)
    fp_twice = f32.astype(np.float16)
    hit = np.any(bf_once != bf_twice, axis=1) | np.any(fp_once != fp_twice, axis=1)
    return [float(v) for v in pool[hit][:n]]


def tie_values():
    """fp32 values at, and one and two ulps around, every tie and grid point
    of every format (incl. int8 n + 0.5), both signs."""
    vals = []
    for fmt in Q.FORMATS:
        g, _ = Q._table(fmt)
        vals += [g, (g[:-1] + g[1:]) / 2, [g[-1] * 1.03125, g[-1] * 1.0625, g[-1] * 2]]
    vals.append(np.arange(-130, 131) + 0.5)
    vals.append(np.arange(-130, 131).astype(np.float64))
    v = np.concatenate([np.asarray(a, np.float64).ravel() for a in vals]).astype(F32)
    b = Q.bits32(np.abs(v)).astype(np.int64)
    b = (b[:, None] + np.arange(-2, 3)[None, :]).ravel()
    b = np.unique(b[(b >= 0) & (b < 0x7F800000)]).astype(np.uint32)
    b = np.concatenate([b, b | np.uint32(0x80000000)])
    return Q.from_bits32(b)


def random_f32(n, seed):
    """Random fp32: uniform bit patterns (all classes incl. NaN/inf/subnormal)
    and normally distributed values at several magnitudes."""
    rng = np.random.default_rng(seed)
    bits = Q.from_bits32(rng.integers(0, 1 << 32, n // 2, dtype=np.uint64).astype(np.uint32))
    mags = rng.normal(size=n - n // 2) * (10.0 ** rng.integers(-6, 7, n - n // 2))
    return np.concatenate([bits, mags.astype(F32)])


# ------------------------------------------------------------- the checks
def per_tensor_case(group, xs, xdtype, od, scale, exact, tag, pass_exact=True):
    x32 = Q.widen(xs, xdtype)
    case = (f"quant.per_tensor[{tag}] x={xdtype}{list(xs.shape)} out={od} exact={exact} "
            f"scale={'dynamic' if scale is None else fhex(F32(scale))}")
    inputs = {"x": (xs, xdtype)}
    if scale is not None:
        inputs["scale"] = (np.array([scale], F32), "fp32")
    params = {"out_dtype": od}
    if pass_exact:
        params["exact_division"] = exact
    out = call(group, case, "quant.per_tensor", inputs, params)
    if out is None:
        return
    eq, es = Q.quant_per_tensor(x32, od, scale, exact)
    ok = check_dtype(case + " q", out["q"][1], [od] if od == "int8" else [od, "uint8"])
    ok &= check_dtype(case + " scale", out["scale"][1], ["fp32"])
    ok &= compare(group, case + " scale", out["scale"][0], es,
                  lambda i: "(scale output)")
    ok &= compare(group, case + " q", out["q"][0], eq,
                  lambda i: f"x={xdesc(xs, xdtype, i)} s={fhex(es[0])}")
    case_done(group, ok)


def check_per_tensor_static():
    group = "per_tensor static"
    scales = static_scales()
    print(f"-- quant.per_tensor static: {len(scales)} scales x fp16/bf16 all patterns x 3 dtypes x 2",
          flush=True)
    for xdtype in ("fp16", "bf16"):
        xs = ALL16.reshape(256, 256)
        for s in scales:
            for od in ("fp8_e4m3fn", "fp8_e4m3fnuz", "int8"):
                for exact in (False, True):
                    per_tensor_case(group, xs, xdtype, od, s, exact, "all16")
    # The default of exact_division is false.
    per_tensor_case(group, ALL16, "fp16", "fp8_e4m3fn", 0.1, False, "default", pass_exact=False)
    # fp32 path: every fp16 pattern widened, random fp32 and the tie set.
    x16 = Q.widen(ALL16, "fp16")
    rnd = random_f32(1 << 17, 11)
    for s in scales[::6]:
        for od in ("fp8_e4m3fn", "fp8_e4m3fnuz", "int8"):
            for exact in (False, True):
                per_tensor_case(group, x16, "fp32", od, s, exact, "fp16-as-fp32")
                per_tensor_case(group, rnd, "fp32", od, s, exact, "random")
    ties = tie_values()
    for k in list(range(-24, 25, 3)) + [0]:
        s = F32(2.0 ** k)
        xt = (ties.astype(np.float64) * 2.0 ** k).astype(F32)
        for od in ("fp8_e4m3fn", "fp8_e4m3fnuz", "int8"):
            for exact in (False, True):
                per_tensor_case(group, xt, "fp32", od, float(s), exact, f"ties*2^{k}")
    for s in (0.1, 1 / 3, 0.7, 1 / 448):
        xt = (ties.astype(np.float64) * s).astype(F32)
        for od in ("fp8_e4m3fn", "fp8_e4m3fnuz", "int8"):
            for exact in (False, True):
                per_tensor_case(group, xt, "fp32", od, s, exact, "ties*s")


def check_per_tensor_dynamic():
    group = "per_tensor dynamic"
    print("-- quant.per_tensor dynamic", flush=True)
    rng = np.random.default_rng(21)
    for xdtype in ("fp16", "bf16"):
        fin = finite16(xdtype)
        sets = [("all16", ALL16.reshape(16, 64, 64))]
        # Chunks in bit order (amax of every magnitude, NaN/inf chunks, -0).
        step = 2048 if QUICK else 1024
        for c in range(0, 65536, step):
            sets.append((f"chunk{c:04x}", ALL16[c:c + 1024].reshape(32, 32)))
        perm = rng.permutation(fin)
        for c in range(0, 65536 if not QUICK else 16384, 4096):
            sets.append((f"perm{c}", perm[c:c + 4096]))
        # Tiny amax: subnormals only (bf16: s subnormal, 1/s overflows).
        sub = fin[(Q.widen(fin, xdtype) != 0) & (np.abs(Q.widen(fin, xdtype)) < 2.0 ** -120)]
        sets.append(("tiny", sub))
        sets.append(("tiny+0", np.concatenate([sub, np.array([0, 0x8000], np.uint16)])))
        sets.append(("zeros", np.array([0, 0x8000, 0, 0], np.uint16)))
        nan = 0x7E00 if xdtype == "fp16" else 0x7FC0
        inf = 0x7C00 if xdtype == "fp16" else 0x7F80
        sets.append(("nonfinite", np.array([nan, inf, inf | 0x8000, nan | 0x8000], np.uint16)))
        sets.append(("nonfinite+1", np.array([nan, inf, 0x3C00 if xdtype == "fp16" else 0x3F80], np.uint16)))
        for tag, xs in sets:
            for od in ("fp8_e4m3fn", "fp8_e4m3fnuz", "int8"):
                for exact in (False, True):
                    per_tensor_case(group, xs, xdtype, od, None, exact, tag)
    rnd = random_f32(1 << 16, 23)
    fin = rnd[np.isfinite(rnd)]
    for k in (-40, -20, -5, 0, 5, 20, 30):
        xs = (rng.normal(size=4096) * 10.0 ** k).astype(F32)
        for od in ("fp8_e4m3fn", "fp8_e4m3fnuz", "int8"):
            for exact in (False, True):
                per_tensor_case(group, xs.reshape(2, 2048), "fp32", od, None, exact, f"normal1e{k}")
    for od in ("fp8_e4m3fn", "fp8_e4m3fnuz", "int8"):
        for exact in (False, True):
            per_tensor_case(group, rnd, "fp32", od, None, exact, "random")
            per_tensor_case(group, fin[np.abs(fin) < 1e-38], "fp32", od, None, exact, "random-tiny")
            per_tensor_case(group, np.array([1e-45, 0, -0.0, 3e-45], F32), "fp32", od, None, exact, "min-subnormal")
            per_tensor_case(group, tie_values(), "fp32", od, None, exact, "ties")


def per_token_case(group, xs, xdtype, od, ub, tag, exact=None):
    """exact=None: exact_division not passed (default false)."""
    x32 = Q.widen(xs, xdtype)
    case = f"quant.per_token[{tag}] x={xdtype}{list(xs.shape)} out={od} scale_ub={ub} exact={exact}"
    params = {"out_dtype": od}
    if ub is not None:
        params["scale_ub"] = float(ub)
    if exact is not None:
        params["exact_division"] = exact
    out = call(group, case, "quant.per_token", {"x": (xs, xdtype)}, params)
    if out is None:
        return
    eq, es = Q.quant_per_token(x32, od, ub, bool(exact))
    K = xs.shape[-1]
    ok = check_dtype(case + " q", out["q"][1], [od] if od == "int8" else [od, "uint8"])
    ok &= check_dtype(case + " scales", out["scales"][1], ["fp32"])
    ok &= compare(group, case + " scales", out["scales"][0], es,
                  lambda i: f"row {i} amax_row={fhex(Q._amax_finite(x32.reshape(-1, K)[i]))}")
    ok &= compare(group, case + " q", out["q"][0], eq,
                  lambda i: f"x={xdesc(xs, xdtype, i)} row scale={fhex(es.reshape(-1)[i // K])}")
    case_done(group, ok)


def check_per_token():
    group = "per_token"
    print("-- quant.per_token", flush=True)
    rng = np.random.default_rng(31)
    ubs = [None, 1.0, 0.1, 1e-3, 65504.0, 1e30, 1e-40, 3.0e-7]
    if QUICK:
        ubs = ubs[:3]
    for xdtype in ("fp16", "bf16", "fp32"):
        src = ALL16 if xdtype != "fp32" else None
        if xdtype == "fp32":
            x = random_f32(65536, 33)
            arrs = [("rand-K256", x.reshape(256, 256)), ("rand-K64-3d", x.reshape(32, 32, 64)),
                    ("fp16pat-K128", Q.widen(ALL16, "fp16").reshape(512, 128))]
        else:
            perm = rng.permutation(src)
            arrs = [("bitorder-K256", src.reshape(256, 256)),
                    ("bitorder-3d", src.reshape(16, 16, 256)),
                    ("perm-K64", perm.reshape(1024, 64)),
                    ("K1", src.reshape(65536, 1)),
                    ("perm-K7", perm[:65534].reshape(-1, 7))]
        for tag, xs in arrs:
            for od in ("fp8_e4m3fn", "fp8_e4m3fnuz", "int8"):
                for ub in ubs:
                    per_token_case(group, xs, xdtype, od, ub, tag)
                # exact_division: not in docs/design.md's per_token row, but per_token
                # is "the same as dynamic per-tensor" (docs/numerics.md).
                for ub in (None, 0.1, 1e-40):
                    per_token_case(group, xs, xdtype, od, ub, tag, exact=True)
                per_token_case(group, xs, xdtype, od, None, tag, exact=False)
    # Rows of every kind: all zero, all NaN/inf, one finite among non-finite.
    xs = np.array([[0, 0, 0, 0], [0x7E00, 0x7C00, 0xFC00, 0x7E00], [0x7C00, 0x3C00, 0, 0x8000],
                   [0x0001, 0x8001, 0, 0x0002], [0x7BFF, 0xFBFF, 0x0001, 0x8000]], np.uint16)
    for od in ("fp8_e4m3fn", "fp8_e4m3fnuz", "int8"):
        for ub in (None, 1e-3):
            for exact in (None, True):
                per_token_case(group, xs, "fp16", od, ub, "special-rows", exact)
    # Tiny rows: amax / dtype_max is subnormal, 1/s overflows to inf (fast).
    xs = np.array([[0x0040, 0x0000, 0x0020, 0x8000], [0x0001, 0x0000, 0x8001, 0x0000]], np.uint16)
    for od in ("fp8_e4m3fn", "fp8_e4m3fnuz", "int8"):
        for exact in (None, True):
            per_token_case(group, xs, "bf16", od, None, "tiny-rows", exact)


def per_token_group_case(group, xs, xdtype, od, g, rule, exact, tag):
    """od, g, rule, exact: None = not passed (the defaults: fp8_e4m3fn, 128, none, false)."""
    x32 = Q.widen(xs, xdtype)
    case = f"quant.per_token_group[{tag}] x={xdtype}{list(xs.shape)} out={od} G={g} rule={rule} exact={exact}"
    params = {}
    for name, v in (("out_dtype", od), ("group_size", g), ("scale_rule", rule), ("exact_division", exact)):
        if v is not None:
            params[name] = v
    out = call(group, case, "quant.per_token_group", {"x": (xs, xdtype)}, params)
    if out is None:
        return
    odn, gn = od or "fp8_e4m3fn", g or 128
    eq, es = Q.quant_per_token_group(x32, odn, gn, rule, bool(exact))
    ok = check_dtype(case + " q", out["q"][1], [odn] if odn == "int8" else [odn, "uint8"])
    ok &= check_dtype(case + " scales", out["scales"][1], ["fp32"])
    ok &= compare(group, case + " scales", np.asarray(out["scales"][0]).reshape(es.shape), es,
                  lambda i: f"group {i} amax={fhex(Q._amax_finite(x32.reshape(-1, gn)[i]))}")
    ok &= compare(group, case + " q", out["q"][0], eq,
                  lambda i: f"x={xdesc(xs, xdtype, i)} group scale={fhex(es.reshape(-1)[i // gn])}")
    case_done(group, ok)


def check_per_token_group():
    """Every fp16/bf16 pattern in several group shapes (each group's amax
    gives its own scale: thousands of scales per array), both scale rules,
    both division modes, every output dtype; fp32 random and tiny groups."""
    group = "per_token_group"
    print("-- quant.per_token_group", flush=True)
    rng = np.random.default_rng(37)
    gs = [(128, "bitorder-K512", 512), (64, "perm-K256", 256), (8, "perm-K64", 64), (24, "perm-K96", 96),
          (2048, "bitorder-K4096", 4096), (1, "K3", 3), (7, "perm-K7", 7)]
    if QUICK:
        gs = gs[:4]
    for xdtype in ("fp16", "bf16"):
        perm = rng.permutation(ALL16)
        for g, tag, K in gs:
            src = ALL16 if tag.startswith("bitorder") else perm
            xs = src[: len(src) // K * K].reshape(-1, K)
            for od in ("fp8_e4m3fn", "fp8_e4m3fnuz", "int8"):
                for rule in (None, "pow2_up"):
                    per_token_group_case(group, xs, xdtype, od, g, rule, None, tag)
                per_token_group_case(group, xs, xdtype, od, g, "pow2_up", True, tag)
                per_token_group_case(group, xs, xdtype, od, g, "exact", True, tag)
    x = random_f32(65536, 41)
    for od in (None, "int8"):
        per_token_group_case(group, x.reshape(64, 1024), "fp32", od, None, None, None, "rand-default-G")
        per_token_group_case(group, x.reshape(16, 16, 256), "fp32", od, 32, "pow2_up", None, "rand-3d")
        per_token_group_case(group, x[:384], "fp32", od, 128, "pow2_up", False, "rank1")
    # Groups of every kind: all zero, all NaN/inf, tiny (s subnormal: pow2_up
    # rounds it to a normal power of two), the largest finite values.
    xs = np.array([[0, 0, 0, 0, 0x7E00, 0x7C00, 0xFC00, 0x7E00], [0x7C00, 0x3C00, 0, 0x8000, 0x0001, 0x8001, 0, 0x0002],
                   [0x7BFF, 0xFBFF, 0x0001, 0x8000, 0x3C01, 0x3C00, 0x3BFF, 0x0400]], np.uint16)
    for od in ("fp8_e4m3fn", "fp8_e4m3fnuz", "int8"):
        for rule in (None, "pow2_up"):
            for exact in (None, True):
                per_token_group_case(group, xs, "fp16", od, 4, rule, exact, "special-groups")
                per_token_group_case(group, xs, "bf16", od, 2, rule, exact, "special-groups-bf16")


MX_CONFIGS = [(f, r, e) for f in ("mxfp4", "mxfp8_e4m3fn", "mxfp8_e5m2")
              for r in ("even", "floor", "amax_up", "amax_down")
              for e in (("rne", "half_up") if f == "mxfp4" else ("rne",))]


def mx_case(group, xs, xdtype, fmt, rule, rnd, tag, pass_defaults=True):
    x32 = Q.widen(xs, xdtype)
    K = xs.shape[-1]
    case = f"quant.mx[{tag}] x={xdtype}{list(xs.shape)} format={fmt} scale_rule={rule} rounding={rnd}"
    params = {"format": fmt}
    if pass_defaults or rule != "even":
        params["scale_rule"] = rule
    if pass_defaults or rnd != "rne":
        params["element_rounding"] = rnd
    out = call(group, case, "quant.mx", {"x": (xs, xdtype)}, params)
    if out is None:
        return
    eq, es = Q.quant_mx(x32, fmt, rule, rnd)
    elem = Q.MX_FORMATS[fmt][0]
    per_q = 2 if elem == "fp4_e2m1" else 1
    blocks = x32.reshape(-1, 32)

    def qctx(i):
        e0 = i * per_q
        b = e0 // 32
        xi = ", ".join(xdesc(xs, xdtype, e0 + j) for j in range(per_q))
        return (f"x[{e0}{'..' + str(e0 + 1) if per_q == 2 else ''}]={xi} block {b} "
                f"amax={fhex(Q._amax_finite(blocks[b]))} scale byte={int(es.reshape(-1)[b])}")

    ok = check_dtype(case + " q", out["q"][1], [elem, "uint8"])
    ok &= check_dtype(case + " scales", out["scales"][1], ["e8m0", "uint8"])
    ok &= compare(group, case + " scales", out["scales"][0], es,
                  lambda b: f"block {b} amax={fhex(Q._amax_finite(blocks[b]))} "
                            f"finite={bool(np.all(np.isfinite(blocks[b])))}")
    ok &= compare(group, case + " q", out["q"][0], eq, qctx)
    case_done(group, ok)


def mx_inputs():
    """(tag, storage array, dtype) sets for quant.mx."""
    rng = np.random.default_rng(41)
    sets = []
    for xdtype in ("fp16", "bf16"):
        sets.append((f"{xdtype}-bitorder-K1024", ALL16.reshape(64, 1024), xdtype))
        fin = finite16(xdtype)
        perm = rng.permutation(fin)
        n = (len(perm) // 128) * 128
        p = perm[:n].reshape(-1, 128).copy()
        nan = 0x7E00 if xdtype == "fp16" else 0x7FC0
        inf = 0x7C00 if xdtype == "fp16" else 0x7F80
        p[0, 5], p[1, 40], p[2, 127], p[3, 0] = nan, inf, inf | 0x8000, nan | 0x8000
        sets.append((f"{xdtype}-perm-K128", p, xdtype))
        # Blocks whose members are close in magnitude but with random signs,
        # stride-shuffled so the block amax is a random element.
        s = fin.copy()
        s = s[: (len(s) // 32) * 32].reshape(-1, 32)
        s = rng.permuted(s, axis=1).reshape(-1, 256)
        sets.append((f"{xdtype}-bitorder-shuffled", s, xdtype))
    # fp32 inputs: finite fp16 patterns pre-multiplied by factors so block
    # amaxes span the whole fp32 range (every e8m0 byte reachable).
    base = Q.widen(finite16("fp16"), "fp16")
    base = base[: (len(base) // 256) * 256]
    ks = list(range(-150, 125, 6)) if not QUICK else list(range(-150, 125, 30))
    for k in ks:
        sets.append((f"fp16pat*2^{k}", (base.astype(np.float64) * 2.0 ** k).astype(F32).reshape(-1, 256),
                     "fp32"))
    for f in ([0.1, 1 / 3, 3.0, 7.0, 1e30, 1e-30, 3.4e38 / 65504, 5.2e38 / 65504 / 2, 1e-40 / 65504 * 1e5]
              if not QUICK else [0.1, 3.0]):
        sets.append((f"fp16pat*{f:g}", (base.astype(np.float64) * f).astype(F32).reshape(-1, 256), "fp32"))
    # bf16 storage with wide amaxes: fp16 patterns * 2^k rounded to bf16.
    for k in (-130, -100, -60, -20, 20, 60, 100):
        v = (base.astype(np.float64) * 2.0 ** k).astype(F32)
        sets.append((f"bf16(fp16pat*2^{k})", Q.f32_to_bf16(v).reshape(-1, 256), "bf16"))
    # Tie blocks: elements at grid points and midpoints (+-1 ulp) of every
    # element format times 2^k, with the block amax fixed at the format max
    # times 2^k (or at a random grid point).
    blocks = []
    for fmt in ("fp4_e2m1", "fp8_e4m3fn", "fp8_e5m2"):
        g, _ = Q._table(fmt)
        cand = np.concatenate([g, (g[:-1] + g[1:]) / 2])
        cb = Q.bits32(cand.astype(F32)).astype(np.int64)
        cand = Q.from_bits32(np.concatenate([cb, cb + 1, np.maximum(cb - 1, 0)]).astype(np.uint32))
        for _ in range(2048 if not QUICK else 256):
            k = int(rng.integers(-140, 110))
            blk = rng.choice(cand, 32).astype(np.float64)
            blk[rng.integers(32)] = g[-1] if rng.random() < 0.6 else rng.choice(g)
            blk *= np.where(rng.random(32) < 0.5, -1.0, 1.0)
            blocks.append((blk * 2.0 ** k).astype(F32))
    sets.append(("ties", np.concatenate(blocks).reshape(-1, 128), "fp32"))
    sets.append(("random-fp32", random_f32(1 << 16, 43).reshape(-1, 64), "fp32"))
    fr = random_f32(1 << 17, 44)
    fr = fr[np.isfinite(fr)]
    sets.append(("random-finite-fp32", fr[: (len(fr) // 32) * 32].reshape(-1, 32), "fp32"))
    sp = np.zeros((8, 32), F32)
    sp[1, :] = -0.0
    sp[2, 0] = np.finfo(F32).max
    sp[3, :] = -np.finfo(F32).max
    sp[4, 7] = 1e-45
    sp[5, :] = np.inf
    sp[6, 3] = -np.inf
    sp[7, :] = np.nan
    sets.append(("special-blocks", sp.reshape(2, 128), "fp32"))
    return sets


def check_mx():
    group = "mx"
    sets = mx_inputs()
    print(f"-- quant.mx: {len(MX_CONFIGS)} configs x {len(sets)} input sets", flush=True)
    for fmt, rule, rnd in MX_CONFIGS:
        for tag, xs, xdtype in sets:
            mx_case(group, xs, xdtype, fmt, rule, rnd, tag)
    # Defaults (scale_rule even, element_rounding rne) when omitted; 3-D input.
    xs = ALL16.reshape(8, 64, 128)
    for fmt in ("mxfp4", "mxfp8_e4m3fn", "mxfp8_e5m2"):
        mx_case(group, xs, "bf16", fmt, "even", "rne", "defaults-3d", pass_defaults=False)


def dequant_pt_case(group, q, qdtype, in_dtype, od, s):
    case = f"dequant.per_tensor in={in_dtype} out={od} scale={fhex(F32(s))}"
    out = call(group, case, "dequant.per_tensor",
               {"q": (q, qdtype), "scale": (np.array([s], F32), "fp32")},
               {"in_dtype": in_dtype, "out_dtype": od})
    if out is None:
        return
    ey = Q.dequant_per_tensor(q, s, in_dtype, od)
    ok = check_dtype(case + " y", out["y"][1], [od])
    ok &= compare(group, case + " y", out["y"][0], ey,
                  lambda i: f"q=0x{int(q.reshape(-1)[i]) & 0xFF:02x}", nan_any=True)
    case_done(group, ok)


def check_dequant_per_tensor():
    group = "dequant.per_tensor"
    # Every other static scale (each call is tiny: the cost is per call) plus
    # the scales that tell the fp32 product from a single rounding.
    scales = static_scales()[::2] + [1e-40, 1e-45, 3.4028234663852886e38] + double_rounding_scales()
    print(f"-- dequant.per_tensor: every code x {len(scales)} scales x 3 x 3", flush=True)
    codes = np.arange(256, dtype=np.uint8).reshape(16, 16)
    for s in scales:
        for in_dtype in ("fp8_e4m3fn", "fp8_e4m3fnuz", "int8"):
            q, qd = (codes.view(np.int8), "int8") if in_dtype == "int8" else (codes, "uint8")
            for od in ("fp32", "fp16", "bf16"):
                dequant_pt_case(group, q, qd, in_dtype, od, s)


def dequant_mx_case(group, q, scales, fmt, od, tag):
    case = f"dequant.mx[{tag}] format={fmt} out={od} q{list(q.shape)}"
    out = call(group, case, "dequant.mx", {"q": (q, "uint8"), "scales": (scales, "uint8")},
               {"format": fmt, "out_dtype": od})
    if out is None:
        return
    ey = Q.dequant_mx(q, scales, fmt, od)
    fp4 = fmt == "mxfp4"

    def ctx(i):
        K = ey.shape[-1]
        qi = (i // K) * q.shape[-1] + (i % K) // (2 if fp4 else 1)
        b = int(scales.reshape(-1)[i // 32])
        code = int(q.reshape(-1)[qi])
        if fp4:
            code = (code >> 4) if i % 2 else (code & 0xF)
        return f"code=0x{code:02x} scale byte=0x{b:02x}"

    ok = check_dtype(case + " y", out["y"][1], [od])
    ok &= compare(group, case + " y", out["y"][0], ey, ctx, nan_any=True)
    case_done(group, ok)


def check_dequant_mx():
    group = "dequant.mx"
    print("-- dequant.mx: every code x every e8m0 byte x 3 formats x 3", flush=True)
    rows = np.arange(256, dtype=np.uint8)
    allb = np.tile(np.arange(256, dtype=np.uint8), (256, 1))          # [256, 256] every byte per row
    for fmt in ("mxfp4", "mxfp8_e4m3fn", "mxfp8_e5m2"):
        nblk = (512 if fmt == "mxfp4" else 256) // 32
        same = np.repeat(rows[:, None], nblk, axis=1)                   # row r: scale byte r
        mixed = ((rows[:, None].astype(np.int64) * 7 + np.arange(nblk)[None, :] * 37) % 256).astype(np.uint8)
        for od in ("fp32", "fp16", "bf16"):
            dequant_mx_case(group, allb, same, fmt, od, "row-scale")
            dequant_mx_case(group, allb, mixed, fmt, od, "mixed-scale")
            dequant_mx_case(group, allb.reshape(4, 64, 256), mixed.reshape(4, 64, nblk), fmt, od, "3d")


def check_bad_inputs():
    group = "bad inputs"
    print("-- bad inputs", flush=True)
    if ORACLE_ONLY:
        return

    def expect_error(case, op, inputs, params, words):
        try:
            moelib.run(op, inputs, params)
        except moelib.MoeError as e:
            ok = e.status == -1 and any(w in e.msg for w in words)
            if not ok:
                emit(f"MISMATCH {case}: status {e.status} msg {e.msg!r}, expected -1 naming {words}")
            case_done(group, ok)
            return
        except Exception as e:  # noqa: BLE001
            emit(f"MISMATCH {case}: unexpected {e!r}")
            case_done(group, False)
            return
        emit(f"MISMATCH {case}: no error")
        case_done(group, False)

    x = np.ones((2, 48), F32)
    expect_error("mx K=48", "quant.mx", {"x": (x, "fp32")}, {"format": "mxfp4"}, ["x", "K"])
    x = np.ones((2, 64), F32)
    for f in ("mxfp8_e4m3fn", "mxfp8_e5m2"):
        expect_error(f"mx half_up {f}", "quant.mx", {"x": (x, "fp32")},
                     {"format": f, "element_rounding": "half_up"}, ["element_rounding", "half_up"])
    for s in (0.0, -1.0, np.inf, np.nan, -0.0, -1e-45):
        expect_error(f"static scale {s}", "quant.per_tensor",
                     {"x": (x, "fp32"), "scale": (np.array([s], F32), "fp32")},
                     {"out_dtype": "fp8_e4m3fn"}, ["scale"])
        expect_error(f"dequant scale {s}", "dequant.per_tensor",
                     {"q": (np.zeros(4, np.uint8), "uint8"), "scale": (np.array([s], F32), "fp32")},
                     {"in_dtype": "fp8_e4m3fn", "out_dtype": "fp32"}, ["scale"])


def main():
    t0 = time.time()
    np.seterr(all="ignore")
    Q.self_check(verbose=True)
    if not ORACLE_ONLY:
        print(f"MOE_LIB={os.environ.get('MOE_LIB', 'libmoe.so')}", flush=True)
        try:
            moelib.lib()
        except OSError as e:
            print(f"cannot load libmoe: {e}")
            print("0 passed, 1 failed")
            return 1
    only = [a[len("--only="):] for a in sys.argv if a.startswith("--only=")]  # e.g. --only=per_token_group
    for fn in (check_per_tensor_static, check_per_tensor_dynamic, check_per_token, check_per_token_group, check_mx,
               check_dequant_per_tensor, check_dequant_mx, check_bad_inputs):
        if only and fn.__name__ != "check_" + only[0]:
            continue
        t = time.time()
        try:
            fn()
        except Exception:  # noqa: BLE001 - a harness crash is a failure, not a pass
            traceback.print_exc()
            ST.failed += 1
        print(f"   {fn.__name__}: {time.time() - t:.1f}s", flush=True)
    for g, (p, f, e, m) in ST.by_group.items():
        print(f"   {g:20s} {p:6d} cases passed {f:4d} failed, {e:12d} elements, {m} mismatches")
    if ST.printed > MAX_PRINT_TOTAL:
        print(f"   ({ST.printed - MAX_PRINT_TOTAL} more mismatch lines not shown)")
    print(f"quant oracle: {ST.elements} elements checked bit-exact, {ST.mismatches} mismatches, "
          f"{ST.errors} op errors ({time.time() - t0:.1f}s)")
    print(f"{ST.passed} passed, {ST.failed} failed")
    return 0 if ST.failed == 0 and ST.mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
