"""Writes the seed corpus of the fuzz targets into fuzz/corpus/ (run once;
the files are kept in the repository): small valid inputs of every kind
each target decodes, so the fuzzers start from the formats' structure, and
two refused at the NUL checks.

  .venv/bin/python fuzz/make_corpus.py"""
import json
import os
import struct
import sys

import numpy as np
from tritonclient.grpc import service_pb2 as pb

HERE = os.path.dirname(os.path.abspath(__file__))


def write(kind, name, data):
    d = os.path.join(HERE, "corpus", kind)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def safetensors(tensors, metadata=None):
    """tensors: {name: (dtype name, shape, bytes)} -> file bytes (the format's layout)."""
    header, blobs, off = {}, [], 0
    for name, (dt, shape, raw) in tensors.items():
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


def main():
    rng = np.random.default_rng(0)
    write("safetensors", "one_f32", safetensors({"w2": ("F32", [2, 3], rng.random(6, np.float32).tobytes())}))
    write("safetensors", "mixed", safetensors({
        "w13": ("BF16", [1, 4, 2], bytes(16)), "w13_scales": ("F32", [1, 4], bytes(16)),
        "w13_qweight": ("U8", [1, 4, 1], bytes(4)), "ids": ("I32", [2], bytes(8))}, {"format": "pt"}))
    write("safetensors", "fp8_i8", safetensors({"a": ("F8_E4M3", [4], bytes(4)), "b": ("I8", [2, 2], bytes(4)),
                                                "c": ("F16", [1], bytes(2))}))
    write("safetensors", "empty_and_scalar", safetensors({"e": ("F32", [0], b""), "s": ("F32", [], bytes(4))}))
    write("safetensors", "unsupported_dtype", safetensors({"d": ("F64", [1], bytes(8))}))

    base = {"num_experts": 8, "hidden_size": 128, "intermediate_size": 64}
    configs = {
        "bf16": {**base, "scheme": "bf16", "top_k": 2},
        "fp16_routing": {**base, "scheme": "fp16", "top_k": 2, "scoring": "sigmoid", "renormalize": True,
                         "num_expert_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5},
        "wna16": {**base, "scheme": "wna16", "bits": 4, "group_size": 32, "has_zero_points": True},
        "fp8_block": {**base, "scheme": "fp8", "weight_scale": "block", "block_n": 64, "block_k": 64},
        "fp8_act": {**base, "scheme": "fp8", "weight_scale": "per_tensor", "has_activation_scales": True},
        "mxfp4_bias": {**base, "scheme": "mxfp4", "activation": "swiglu_oai", "has_bias": True},
        "shard": {**base, "global_num_experts": 32, "expert_offset": 8},
    }
    for name, c in configs.items():
        write("expert_config", name, json.dumps(c))

    x = rng.standard_normal((4, 64)).astype(np.float32)
    cases = [
        ("quant.per_tensor", {"x": ("FP32", x)}, {"out_dtype": "fp8_e4m3fn"}),
        ("quant.per_token", {"x": ("FP32", x)}, {"out_dtype": "int8"}),
        ("quant.per_token_group", {"x": ("FP32", x)}, {"group_size": 16, "scale_rule": "pow2_up"}),
        ("quant.mx", {"x": ("FP32", x)}, {"format": "mxfp4"}),
        ("dequant.per_tensor", {"q": ("UINT8", np.zeros((4, 64), np.uint8)), "scale": ("FP32", np.ones(1, np.float32))},
         {"in_dtype": "fp8_e4m3fn", "out_dtype": "bf16"}),
        ("dequant.mx", {"q": ("UINT8", np.zeros((4, 32), np.uint8)), "scales": ("UINT8", np.full((4, 2), 127, np.uint8))},
         {"format": "mxfp4", "out_dtype": "fp32"}),
        ("moe.topk", {"router_logits": ("FP32", rng.standard_normal((4, 8)).astype(np.float32))},
         {"top_k": 2, "renormalize": True}),
        ("fused_moe", {"hidden_states": ("BF16", np.full((2, 16), 0x3f80, np.uint16)),  # bf16 ones
                       "w13": ("BF16", np.full((4, 32, 16), 0x3c00, np.uint16)),
                       "w2": ("BF16", np.full((4, 16, 16), 0x3c00, np.uint16)),
                       "topk_ids": ("INT32", np.array([[0, 1], [2, 3]], np.int32)),
                       "topk_weights": ("FP32", np.full((2, 2), 0.5, np.float32))}, {}),
    ]
    for k, (model, ins, params) in enumerate(cases):
        r = pb.ModelInferRequest(model_name=model, id=f"req{k}")
        for name, (dt, a) in ins.items():
            t = r.inputs.add()
            t.name, t.datatype = name, dt
            t.shape.extend(a.shape)
            r.raw_input_contents.append(a.tobytes())
        for key, v in params.items():
            if isinstance(v, bool):
                r.parameters[key].bool_param = v
            elif isinstance(v, int):
                r.parameters[key].int64_param = v
            else:
                r.parameters[key].string_param = v
        write("infer_request", f"{k:02d}_{model}", r.SerializeToString())
    # the same requests as REST infer bodies (fuzz_rest_infer.c: byte 0 the
    # model's index in this list, byte 1 the header-length case, bytes 2..5
    # the length): JSON tensors, and the binary-data extension
    out_name = {"quant": "q", "dequant": "y", "moe": "topk_ids", "fused_moe": "output"}
    for k, (model, ins, params) in enumerate(cases):
        def as_json(dt, a):
            if dt == "BF16":  # the bits -> the values they stand for
                return (a.astype(np.uint32) << 16).view(np.float32).ravel().tolist()
            return a.ravel().tolist()
        body = {"id": f"req{k}", "parameters": params,
                "inputs": [{"name": n, "datatype": dt, "shape": list(a.shape), "data": as_json(dt, a)}
                           for n, (dt, a) in ins.items()]}
        write("rest_infer", f"{k:02d}_{model}_json", bytes([k, 0, 0, 0, 0, 0]) + json.dumps(body).encode())
        header = {"parameters": params,
                  "inputs": [{"name": n, "datatype": dt, "shape": list(a.shape),
                              "parameters": {"binary_data_size": a.nbytes}} for n, (dt, a) in ins.items()],
                  "outputs": [{"name": out_name[model.split(".")[0]], "parameters": {"binary_data": True}}]}
        h = json.dumps(header).encode()
        raw = b"".join(a.tobytes() for _, a in ins.values())
        write("rest_infer", f"{k:02d}_{model}_binary", bytes([k, 1]) + len(h).to_bytes(4, "little") + h + raw)
    # typed contents instead of raw bytes, and a requested output
    r = pb.ModelInferRequest(model_name="quant.per_token")
    t = r.inputs.add()
    t.name, t.datatype = "x", "FP32"
    t.shape.extend([2, 4])
    t.contents.fp32_contents.extend([1.0] * 8)
    r.parameters["out_dtype"].string_param = "int8"
    r.outputs.add().name = "q"
    write("infer_request", "typed_contents", r.SerializeToString())
    # refused ones, near the checks a mutation would otherwise rarely reach:
    # a NUL inside a parameter key (protobuf-c would cut it to out_dtype) and
    # a JSON string holding \u0000 (cJSON would cut it)
    r = pb.ModelInferRequest(model_name="quant.per_token")
    t = r.inputs.add()
    t.name, t.datatype = "x", "FP32"
    t.shape.extend([1, 4])
    r.raw_input_contents.append(bytes(16))
    r.parameters["out_dtype\0x"].string_param = "int8"
    write("infer_request", "refused_nul_key", r.SerializeToString())
    body = {"parameters": {"out_dtype": "int8"},
            "inputs": [{"name": "x\u0000y", "datatype": "FP32", "shape": [1, 4], "data": [0.0] * 4}]}
    write("rest_infer", "refused_nul_name", bytes([1, 0, 0, 0, 0, 0]) + json.dumps(body).encode())
    http_conn_seeds()
    upload_seeds(rng)
    return 0


def http_conn_seeds():
    """fuzz_http_conn.c: byte 0 seeds the split points, then the byte stream of one connection."""
    get = b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n"
    body = b'{"inputs": []}'
    seeds = {
        "get": get,
        "pipelined": get + b"GET /v2 HTTP/1.1\r\nHost: x\r\n\r\n" + b"GET /e HTTP/1.1\r\nConnection: close\r\n\r\n",
        "post_length": b"POST /v2/models/m/infer HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body) + body + get,
        "chunked": b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n" + get,
        "expect_ihcl_auth": b"POST /x HTTP/1.1\r\nExpect: 100-continue\r\nInference-Header-Content-Length: 4\r\n"
                            b"Authorization: Bearer abcdefghijklmnop\r\nContent-Length: 8\r\n\r\n{}  rest",
        "encoded": b"POST /x HTTP/1.1\r\nContent-Encoding: gzip\r\nContent-Length: 2\r\n\r\nab",
        "too_large": b"POST /x HTTP/1.1\r\nContent-Length: 5000\r\n\r\n" + b"a" * 64,
        "http10": b"GET /metrics HTTP/1.0\r\n\r\n",
        "malformed": b"GET / HTTP/1.1\r\nBad Header\r\n\r\n",
        # answered later ("/d"), with requests held behind it; the FIN's run: the last says close
        "deferred": b"GET /d1 HTTP/1.1\r\n\r\n" + get + b"GET /d2 HTTP/1.1\r\nConnection: close\r\n\r\n",
        "deferred_keepalive": b"POST /d HTTP/1.1\r\nContent-Length: 2\r\n\r\nab",
    }
    for k, (name, stream) in enumerate(seeds.items()):
        write("http_conn", name, bytes([k * 37 % 256]) + stream)


def upload_seeds(rng):
    """fuzz_upload.c: a program of steps (its comments say how each reads)."""
    w13 = rng.integers(0, 1 << 16, 2 * 16 * 16, dtype=np.uint16).tobytes()  # bf16 [2, 16, 16]
    w2 = rng.integers(0, 1 << 16, 2 * 16 * 8, dtype=np.uint16).tobytes()    # bf16 [2, 16, 8]
    header = bytes([1, 0b110])  # name fz, the valid config, chunk offsets and checksums
    whole = lambda which, data: bytes([2, which, 0b111, len(data) // 8]) + data  # shape, nbytes, xxh3 right
    write("upload", "valid", header + whole(0, w13) + whole(1, w2) + bytes([4]))
    # w13 in two chunks (no checksums: one chunk's would not be the tensor's)
    split = bytes([1, 0b010, 2, 0, 0b011, 64]) + w13[:512] + bytes([0, 3, 0, 64]) + w13[512:]
    write("upload", "split", split + whole(1, w2) + bytes([4]))
    write("upload", "abort", header + whole(0, w13) + bytes([5]))
    write("upload", "bad_nbytes", header + bytes([2, 0, 8, 3, 4, 6, 1, 0, 9, 0, 4]))
    write("upload", "builtin_name", bytes([1, 2 << 3, 4]))


if __name__ == "__main__":
    sys.exit(main())
