#!/usr/bin/env python3
"""Splits an expert set into M shards of contiguous experts, one per moed pod.

  deploy/tools/split-expert-set.py SET_DIR OUT_DIR --shards M [--name NAME]

Writes OUT_DIR/shard-0/NAME ... OUT_DIR/shard-{M-1}/NAME, each an expert set
(docs/expert-set.md) holding experts [offset, offset + n) of the layer:
config.json with num_experts = n, expert_offset and global_num_experts set
(everything else unchanged), and one weights.safetensors with each expert
tensor's rows [offset, offset + n) along its first axis (bytes copied, not
converted). correction_bias covers every global expert and is copied whole.
Shard i gets experts i*E/M .. (i+1)*E/M (rounded down), so sizes differ by at
most one when M does not divide E. NAME defaults to SET_DIR's name.

Serve shard i from pod i (deploy/k8s/shards: `moec -a moed-shard-i.moed-shard.
moed.svc:8001 upload OUT_DIR/shard-i/NAME --name NAME`); send each request to
every shard and add their outputs (docs/deploy.md "Expert shards across pods").
Python 3 only, no packages."""
import argparse
import json
import os
import struct
import sys

ELEM = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
        "U8": 1, "I8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
WHOLE = {"correction_bias"}  # [global_num_experts]: every shard keeps all of it


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    out = {}
    for name, d in header.items():
        if name == "__metadata__":
            continue
        a, b = d["data_offsets"]
        out[name] = (d["dtype"], d["shape"], raw[base + a:base + b])
    return out


def write_safetensors(path, tensors):
    """tensors: {name: (dtype, shape, bytes)}; larger elements first so that
    every tensor's data is aligned to its element size; header padded to 8."""
    order = sorted(tensors, key=lambda k: (-ELEM[tensors[k][0]], k))
    header, off = {}, 0
    for name in order:
        dtype, shape, data = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(data)]}
        off += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for name in order:
            f.write(tensors[name][2])
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("set_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--shards", type=int, required=True)
    ap.add_argument("--name")
    a = ap.parse_args()
    name = a.name or os.path.basename(os.path.normpath(a.set_dir))
    with open(os.path.join(a.set_dir, "config.json")) as f:
        cfg = json.load(f)
    e = cfg["num_experts"]
    offset0 = cfg.get("expert_offset", 0)
    global_e = cfg.get("global_num_experts", e)
    if not 1 <= a.shards <= e:
        sys.exit(f"split-expert-set: --shards {a.shards}: want 1 ..= num_experts ({e})")
    tensors = {}
    for fn in sorted(os.listdir(a.set_dir)):
        if fn.endswith(".safetensors") and not fn.startswith("."):
            for k, v in read_safetensors(os.path.join(a.set_dir, fn)).items():
                if k in tensors:
                    sys.exit(f"split-expert-set: {k}: in two files")
                tensors[k] = v
    if not tensors:
        sys.exit(f"split-expert-set: {a.set_dir}: no .safetensors files")
    for k, (dtype, shape, data) in tensors.items():
        if k not in WHOLE and (not shape or shape[0] != e):
            sys.exit(f"split-expert-set: {k}: shape {shape} does not start with num_experts ({e})")
        if dtype not in ELEM:
            sys.exit(f"split-expert-set: {k}: dtype {dtype} not handled")
    for i in range(a.shards):
        lo, hi = i * e // a.shards, (i + 1) * e // a.shards
        part = {}
        for k, (dtype, shape, data) in tensors.items():
            if k in WHOLE:
                part[k] = (dtype, shape, data)
            else:
                row = len(data) // e
                part[k] = (dtype, [hi - lo] + shape[1:], data[lo * row:hi * row])
        sc = dict(cfg)
        sc["num_experts"] = hi - lo
        sc["expert_offset"] = offset0 + lo
        sc["global_num_experts"] = global_e
        d = os.path.join(a.out_dir, f"shard-{i}", name)
        os.makedirs(d, exist_ok=True)
        write_safetensors(os.path.join(d, "weights.safetensors"), part)
        with open(os.path.join(d, "config.json"), "w") as f:  # last: a directory with config.json is complete
            json.dump(sc, f, indent=1)
            f.write("\n")
        print(f"{d}: experts {offset0 + lo} .. {offset0 + hi - 1} of {global_e}")


if __name__ == "__main__":
    main()
