#!/usr/bin/env python3
"""convert_checkpoint: one MoE layer of a published checkpoint -> an expert set
(a directory with config.json and weights.safetensors, docs/expert-set.md).

Two upstream layouts (docs/expert-set.md "Converting checkpoints" lists the keys):

- DeepSeek-V3 / R1 (`deepseek`): per expert `<prefix>.experts.<e>.{gate,up,down}_proj.weight`
  fp8 e4m3fn with `.weight_scale_inv` F32 block scales [ceil(N/BN), ceil(K/BK)] (a bf16 layer
  without scales becomes a bf16 set); the router's `<prefix>.gate.e_score_correction_bias`
  becomes correction_bias. -> scheme fp8, weight_scale block, activation silu.
- gpt-oss (`gpt-oss`): `<prefix>.experts.gate_up_proj_{blocks,scales,bias}` and
  `<prefix>.experts.down_proj_{blocks,scales,bias}`, fp4 e2m1 blocks [E, N, K/32, 16] with e8m0
  scales [E, N, K/32]; gate and up rows interleaved (gate even), as swiglu_oai expects.
  -> scheme mxfp4 with biases, activation swiglu_oai.

Every shape is checked against the sizes the first tensor fixes; a mismatch names the key.

    convert_checkpoint.py --input DIR_OR_FILE... --layer 3 --out sets/layer3 [--top-k 8 ...]

Needs numpy and safetensors (scripts/deps.sh installs them into .venv).
"""
import argparse
import glob
import json
import os
import re
import sys

import numpy as np
import safetensors
from safetensors import deserialize, serialize_file

# safetensors dtype (header name) -> numpy storage
_STORAGE = {"F32": np.float32, "F16": np.uint16, "BF16": np.uint16, "U8": np.uint8, "I8": np.int8,
            "F8_E4M3": np.uint8, "I32": np.int32}
# the names the package's raw-bytes interface uses since 0.7 (TensorSpec, deserialize)
_SPEC_NAME = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "U8": "uint8", "I8": "int8",
              "F8_E4M3": "float8_e4m3fn", "I32": "int32"}
_HEADER_NAME = {v: k for k, v in _SPEC_NAME.items()}


class ConvertError(Exception):
    pass


def read_tensors(paths, want):
    """{key: (storage array, safetensors dtype)} for the keys where want(key) is true."""
    out = {}
    for path in paths:
        with open(path, "rb") as f:
            for name, t in deserialize(f.read()):
                if not want(name):
                    continue
                dt = _HEADER_NAME.get(t["dtype"], t["dtype"])
                if dt not in _STORAGE:
                    raise ConvertError(f"{path}: {name}: dtype {t['dtype']} not supported")
                if name in out:
                    raise ConvertError(f"{path}: {name}: also in another file")
                out[name] = (np.frombuffer(t["data"], dtype=_STORAGE[dt]).reshape(t["shape"]), dt)
    return out


def input_files(inputs):
    files = []
    for p in inputs:
        if os.path.isdir(p):
            files += sorted(glob.glob(os.path.join(p, "*.safetensors")))
        else:
            files.append(p)
    if not files:
        raise ConvertError("no .safetensors files in the input")
    return files


def expect(key, arr, shape, dtypes):
    a, dt = arr
    if dt not in dtypes:
        raise ConvertError(f"{key}: dtype {dt}, expected {' or '.join(dtypes)}")
    if tuple(a.shape) != tuple(shape):
        raise ConvertError(f"{key}: shape {list(a.shape)}, expected {list(shape)}")
    return a


def cdiv(a, b):
    return -(-a // b)


# ---- DeepSeek-V3 -------------------------------------------------------------------------


def convert_deepseek(t, prefix, block):
    ids = sorted({int(m.group(1)) for k in t for m in [re.match(re.escape(prefix) + r"experts\.(\d+)\.", k)] if m})
    if not ids or ids != list(range(len(ids))):
        raise ConvertError(f"{prefix}experts.<e>: experts {ids[:8]}... are not 0..E-1")
    E = len(ids)
    k0 = f"{prefix}experts.0.gate_proj.weight"
    if k0 not in t:
        raise ConvertError(f"{k0}: missing")
    I, H = t[k0][0].shape
    fp8 = t[k0][1] == "F8_E4M3"
    BN, BK = block
    if fp8 and (H % BK or I % BK or I % BN):
        raise ConvertError(f"block [{BN}, {BK}]: BK must divide H = {H} and I = {I}, BN must divide I "
                           "(gate and up scales are stacked)")
    q13, q2, s13, s2 = [], [], [], []
    for e in ids:
        rows = []
        for proj, (n, k) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            key = f"{prefix}experts.{e}.{proj}.weight"
            if key not in t:
                raise ConvertError(f"{key}: missing")
            w = expect(key, t[key], (n, k), ["F8_E4M3"] if fp8 else ["BF16"])
            s = None
            if fp8:
                skey = key + "_scale_inv"
                if skey not in t:
                    raise ConvertError(f"{skey}: missing")
                s = expect(skey, t[skey], (cdiv(n, BN), cdiv(k, BK)), ["F32"])
            rows.append((w, s))
        q13.append(np.concatenate([rows[0][0], rows[1][0]], axis=0))
        q2.append(rows[2][0])
        if fp8:
            s13.append(np.concatenate([rows[0][1], rows[1][1]], axis=0))
            s2.append(rows[2][1])
    cfg = {"num_experts": E, "hidden_size": int(H), "intermediate_size": int(I), "activation": "silu"}
    if fp8:
        out = {"w13_qweight": (np.stack(q13), "U8"), "w2_qweight": (np.stack(q2), "U8"),
               "w13_scales": (np.stack(s13), "F32"), "w2_scales": (np.stack(s2), "F32")}
        cfg.update({"scheme": "fp8", "weight_scale": "block", "block_n": BN, "block_k": BK})
    else:
        out = {"w13": (np.stack(q13), "BF16"), "w2": (np.stack(q2), "BF16")}
        cfg["scheme"] = "bf16"
    bkey = f"{prefix}gate.e_score_correction_bias"
    if bkey in t:
        out["correction_bias"] = (expect(bkey, t[bkey], (E,), ["F32"]), "F32")
    return cfg, out


# ---- gpt-oss -----------------------------------------------------------------------------


def convert_gpt_oss(t, prefix):
    p = prefix + "experts."
    need = [p + n for n in ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias", "down_proj_blocks",
                            "down_proj_scales", "down_proj_bias")]
    for k in need:
        if k not in t:
            raise ConvertError(f"{k}: missing")
    b13 = t[p + "gate_up_proj_blocks"][0]
    if b13.ndim != 4 or b13.shape[3] != 16 or b13.shape[1] % 2:
        raise ConvertError(f"{p}gate_up_proj_blocks: shape {list(b13.shape)}, expected [E, 2I, H/32, 16]")
    E, I2, HB, _ = b13.shape
    I, H = I2 // 2, HB * 32
    if I % 32:
        raise ConvertError(f"{p}gate_up_proj_blocks: I = {I} is not a multiple of 32")
    # byte j of a block holds elements 2j (low nibble) and 2j + 1: our packing along K as it is
    q13 = expect(p + "gate_up_proj_blocks", t[p + "gate_up_proj_blocks"], (E, I2, H // 32, 16), ["U8"])
    s13 = expect(p + "gate_up_proj_scales", t[p + "gate_up_proj_scales"], (E, I2, H // 32), ["U8"])
    q2 = expect(p + "down_proj_blocks", t[p + "down_proj_blocks"], (E, H, I // 32, 16), ["U8"])
    s2 = expect(p + "down_proj_scales", t[p + "down_proj_scales"], (E, H, I // 32), ["U8"])
    bias_dt = t[p + "gate_up_proj_bias"][1]
    bb13 = expect(p + "gate_up_proj_bias", t[p + "gate_up_proj_bias"], (E, I2), ["BF16", "F32", "F16"])
    bb2 = expect(p + "down_proj_bias", t[p + "down_proj_bias"], (E, H), [bias_dt])
    for key, s in ((p + "gate_up_proj_scales", s13), (p + "down_proj_scales", s2)):
        bad = np.argwhere(s == 0xFF)
        if len(bad):
            raise ConvertError(f"{key}: e8m0 scale byte 0xFF (NaN) at {list(map(int, bad[0]))}")
    cfg = {"scheme": "mxfp4", "num_experts": int(E), "hidden_size": int(H), "intermediate_size": int(I),
           "activation": "swiglu_oai", "has_bias": True}
    out = {"w13_qweight": (q13.reshape(E, I2, H // 2), "U8"), "w13_scales": (s13, "U8"),
           "w2_qweight": (q2.reshape(E, H, I // 2), "U8"), "w2_scales": (s2, "U8"),
           "w13_bias": (bb13, bias_dt), "w2_bias": (bb2, bias_dt)}
    return cfg, out


# ---- driver ---------------------------------------------------------------------------------


def find_prefix(keys, layer, fmt):
    """'model.layers.<L>.mlp.' for the one layer (or the one asked) that has experts."""
    marker = r"experts\.(\d+)\.gate_proj\.weight$" if fmt == "deepseek" else r"experts\.gate_up_proj_blocks$"
    found = sorted({k[:m.start()] for k in keys for m in [re.search(marker, k)] if m})
    if layer is not None:
        found = [f for f in found if re.search(rf"(^|\.)layers\.{layer}\.", f)]
    if len(found) != 1:
        raise ConvertError(f"{fmt} layer: {len(found)} candidates {found[:4]}; pick one with --layer or --prefix")
    return found[0]


def detect_format(keys):
    if any(k.endswith("experts.gate_up_proj_blocks") for k in keys):
        return "gpt-oss"
    if any(re.search(r"experts\.\d+\.gate_proj\.weight$", k) for k in keys):
        return "deepseek"
    raise ConvertError("no MoE experts found (neither DeepSeek-V3 nor gpt-oss key names)")


def save_safetensors(path, tensors):
    """{key: (storage array, safetensors dtype)} -> one file, with the package's raw-bytes
    interface (its numpy one has no fp8): TensorSpec since safetensors 0.7, a dict before."""
    arrs = {k: np.ascontiguousarray(a) for k, (a, _) in tensors.items()}
    if hasattr(safetensors, "TensorSpec"):
        flat = {k: safetensors.TensorSpec(dtype=_SPEC_NAME[dt], shape=list(a.shape), data_ptr=arrs[k].ctypes.data,
                                          data_len=arrs[k].nbytes) for k, (a, dt) in tensors.items()}
    else:
        flat = {k: {"dtype": dt, "shape": list(a.shape), "data": arrs[k].tobytes()} for k, (a, dt) in tensors.items()}
    serialize_file(flat, path)  # arrs stays alive across the call: the specs point into it


def write_set(out_dir, cfg, tensors):
    os.makedirs(out_dir, exist_ok=True)
    save_safetensors(os.path.join(out_dir, "weights.safetensors"), tensors)
    # config last: a directory with config.json is complete
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", nargs="+", required=True, help="checkpoint directory or .safetensors files")
    ap.add_argument("--out", required=True, help="expert-set directory to write")
    ap.add_argument("--format", choices=["deepseek", "gpt-oss"], help="default: from the key names")
    ap.add_argument("--layer", type=int, help="layer number (when the input holds several MoE layers)")
    ap.add_argument("--prefix", help="key prefix up to 'experts.' (e.g. model.layers.3.mlp.)")
    ap.add_argument("--block", type=int, nargs=2, default=[128, 128], metavar=("BN", "BK"),
                    help="deepseek fp8 block size (weight_block_size; default 128 128)")
    ap.add_argument("--top-k", type=int, required=True, help="experts per token (num_experts_per_tok)")
    ap.add_argument("--scoring", choices=["softmax", "sigmoid"], help="deepseek: sigmoid, gpt-oss: softmax")
    ap.add_argument("--no-renormalize", action="store_true", help="do not renormalize the top-k weights")
    ap.add_argument("--num-expert-group", type=int, default=1)
    ap.add_argument("--topk-group", type=int, default=1)
    ap.add_argument("--routed-scaling-factor", type=float, default=1.0)
    a = ap.parse_args(argv)
    try:
        files = input_files(a.input)
        keys = set()
        for path in files:  # names only, from the headers
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                keys |= {k for k in json.loads(f.read(n)) if k != "__metadata__"}
        fmt = a.format or detect_format(keys)
        prefix = a.prefix if a.prefix is not None else find_prefix(keys, a.layer, fmt)
        t = read_tensors(files, lambda k: k.startswith(prefix + "experts.") or k.startswith(prefix + "gate."))
        if fmt == "deepseek":
            cfg, tensors = convert_deepseek(t, prefix, tuple(a.block))
        else:
            cfg, tensors = convert_gpt_oss(t, prefix)
        cfg.update({"top_k": a.top_k, "scoring": a.scoring or ("sigmoid" if fmt == "deepseek" else "softmax"),
                    "renormalize": not a.no_renormalize, "num_expert_group": a.num_expert_group,
                    "topk_group": a.topk_group, "routed_scaling_factor": a.routed_scaling_factor})
        write_set(a.out, cfg, tensors)
    except ConvertError as e:
        print(f"convert_checkpoint: {e}", file=sys.stderr)
        return 1
    print(f"convert_checkpoint: {fmt} layer '{prefix}' -> {a.out} (scheme {cfg['scheme']}, E {cfg['num_experts']}, "
          f"H {cfg['hidden_size']}, I {cfg['intermediate_size']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
