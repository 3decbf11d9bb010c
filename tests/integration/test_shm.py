"""Integration test: Triton's system shared-memory extension against a real
moed on a free loopback port, driven by stock tritonclient
(tritonclient.utils.shared_memory for the regions, tritonclient.grpc for
register / status / unregister and InferInput / InferRequestedOutput
.set_shared_memory). Every op's outputs through shared memory are bit-equal
to the same request with raw contents; each error names its field; a region
unregistered while a request uses it stays mapped until that request ends.

env: MOED (server binary), MOE_MKSET (expert-set writer)."""
import base64
import ctypes
import os
import subprocess
import sys
import tempfile
import threading
import time

import grpc
import numpy as np
import tritonclient.grpc as tc
import tritonclient.http as th
import tritonclient.utils.shared_memory as shm
from tritonclient.grpc import service_pb2 as pb

sys.path.insert(0, os.path.dirname(__file__))
from moed_process import check, exit_with_summary, moed, print_log_tail  # noqa: E402
import test_server as ts  # noqa: E402
from test_server import KSERVE, code_of, infer_pb, make_req  # noqa: E402

KEY = f"/moed_test_shm_{os.getpid()}"
C = grpc.StatusCode


def align(n, a=64):
    return (n + a - 1) // a * a


def region(name, size, suffix=""):
    """A fresh POSIX object KEY+suffix of `size` bytes, through tritonclient."""
    return shm.create_shared_memory_region(name, KEY + suffix, size, create_only=True)


def shm_infer(cli, model, ins, params, out_sizes, in_name="in", out_name="out"):
    """The request of test_server.op_cases with every input read from region
    in_name and every output written to region out_name (64-byte aligned
    offsets, the second and later ones not at 0)."""
    inputs, off = [], 0
    for n, (a, d) in ins.items():
        i = tc.InferInput(n, list(a.shape), KSERVE[d])
        i.set_shared_memory(in_name, a.nbytes, offset=off)
        inputs.append(i)
        off = align(off + a.nbytes)
    outputs, where, off = [], {}, 0
    for n, size in out_sizes.items():
        o = tc.InferRequestedOutput(n)
        o.set_shared_memory(out_name, size, offset=off)
        outputs.append(o)
        where[n] = (off, size)
        off = align(off + size)
    return cli.infer(model, inputs, outputs=outputs, parameters=params), where


def write_inputs(h, ins):
    off = 0
    for a, _ in ins.values():
        shm.set_shared_memory_region(h, [np.ascontiguousarray(a)], offset=off)
        off = align(off + a.nbytes)


def test_ops(cli, ch):
    """Each op of test_server's cases (small: copied while decoding, the
    unbatched ones on the gRPC thread's fast path), plus large inputs
    (> 64 KiB: copied on a worker), through shared memory vs raw contents."""
    rng = np.random.default_rng(7)
    cases = ts.op_cases(rng)
    big = rng.standard_normal((512, 128)).astype(np.float32)  # 256 KiB
    cases.append(("quant.per_token", {"x": (big, "fp32")}, {"out_dtype": "fp8_e4m3fn"}))  # batched
    cases.append(("quant.per_tensor", {"x": (big, "fp32")}, {"out_dtype": "int8"}))  # off the gRPC thread's fast path
    hin, hout = region("in", 1 << 20, "_in"), region("out", 1 << 20, "_out")
    cli.register_system_shared_memory("in", KEY + "_in", 1 << 20)
    cli.register_system_shared_memory("out", KEY + "_out", 1 << 20)
    try:
        for model, ins, params in cases:
            what = f"{model} {params}"
            req = make_req(model, [(n, KSERVE[d], list(a.shape), a.tobytes()) for n, (a, d) in ins.items()], params)
            code, _ = code_of(lambda: infer_pb(ch, req))
            if code != C.OK:  # an op the raw path refuses is test_server's business
                continue
            ref = infer_pb(ch, req)
            sizes = {o.name: len(ref.raw_output_contents[k]) for k, o in enumerate(ref.outputs)}
            write_inputs(hin, ins)
            code, msg = code_of(lambda: shm_infer(cli, model, ins, params, sizes))
            check(code == C.OK, f"{what}: OK through shared memory ({code} {msg})")
            if code != C.OK:
                continue
            res, where = shm_infer(cli, model, ins, params, sizes)
            r = res.get_response()
            meta = {o.name: (o.datatype, list(o.shape)) for o in r.outputs}
            want = {o.name: (o.datatype, list(o.shape)) for o in ref.outputs}
            check(meta == want and all(len(c) == 0 for c in r.raw_output_contents)
                  and len(r.raw_output_contents) == len(r.outputs),
                  f"{what}: response has the outputs' metadata and empty contents")
            for k, o in enumerate(ref.outputs):
                off, size = where[o.name]
                got = shm.get_contents_as_numpy(hout, np.uint8, [size], offset=off).tobytes()
                check(got == ref.raw_output_contents[k], f"{what}: output {o.name} bit-equal ({size} bytes)")
        # mixed: one input raw, one in shared memory; one output each way (raw
        # contents count the raw inputs only, and outputs stay aligned)
        x = rng.standard_normal((8, 64)).astype(np.float32)
        xb = ts.bf16(x)
        ref = infer_pb(ch, make_req("quant.mx", [("x", "BF16", [8, 64], xb.tobytes())], {"format": "mxfp4"}))
        shm.set_shared_memory_region(hin, [xb], offset=128)
        i = tc.InferInput("x", [8, 64], "BF16")
        i.set_shared_memory("in", xb.nbytes, offset=128)
        oq, osc = tc.InferRequestedOutput("q"), tc.InferRequestedOutput("scales")
        oq.set_shared_memory("out", 4096, offset=64)
        res = cli.infer("quant.mx", [i], outputs=[oq, osc], parameters={"format": "mxfp4"})
        ro = {o.name: ref.raw_output_contents[k] for k, o in enumerate(ref.outputs)}
        got_q = shm.get_contents_as_numpy(hout, np.uint8, [len(ro["q"])], offset=64).tobytes()
        check(got_q == ro["q"] and res.as_numpy("scales").tobytes() == ro["scales"],
              "quant.mx bf16: q into shared memory, scales raw: both bit-equal")
        q8 = rng.integers(0, 120, (8, 64), dtype=np.uint8)
        sc = np.array([0.25], np.float32)
        p = {"in_dtype": "fp8_e4m3fn", "out_dtype": "fp32"}
        ref = infer_pb(ch, make_req("dequant.per_tensor", [("q", "UINT8", [8, 64], q8.tobytes()),
                                                            ("scale", "FP32", [1], sc.tobytes())], p))
        shm.set_shared_memory_region(hin, [sc], offset=4)
        iq, isc = tc.InferInput("q", [8, 64], "UINT8"), tc.InferInput("scale", [1], "FP32")
        iq.set_data_from_numpy(q8)
        isc.set_shared_memory("in", 4, offset=4)
        res = cli.infer("dequant.per_tensor", [iq, isc], parameters=p)
        check(res.get_response().raw_output_contents[0] == ref.raw_output_contents[0],
              "dequant.per_tensor: q raw, scale from shared memory: bit-equal")
        test_errors(cli, ch, hout)
        test_stream(cli, hin, hout)
    finally:
        cli.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(hin)
        shm.destroy_shared_memory_region(hout)


def test_stream(cli, hin, hout):
    x = np.arange(2 * 64, dtype=np.float32).reshape(2, 64) / 7
    ref = cli.infer("quant.per_token", [_raw("x", x)], parameters={"out_dtype": "int8"}).get_response()
    shm.set_shared_memory_region(hin, [x])
    results = []
    cli.start_stream(callback=lambda result, error: results.append((result, error)))
    try:
        i = tc.InferInput("x", [2, 64], "FP32")
        i.set_shared_memory("in", x.nbytes)
        o = tc.InferRequestedOutput("q")
        o.set_shared_memory("out", 128, offset=256)
        cli.async_stream_infer("quant.per_token", [i], outputs=[o], parameters={"out_dtype": "int8"})
        for _ in range(100):
            if results:
                break
            time.sleep(0.05)
    finally:
        cli.stop_stream()
    got = shm.get_contents_as_numpy(hout, np.uint8, [128], offset=256).tobytes()
    check(len(results) == 1 and results[0][1] is None and got == ref.raw_output_contents[0],
          "ModelStreamInfer: input and output in shared memory, bit-equal")


def _raw(name, a):
    i = tc.InferInput(name, list(a.shape), "FP32")
    i.set_data_from_numpy(a)
    return i


def expect(fn, code, words, what):
    got, msg = code_of(fn)
    check(got == code and all(w in msg for w in words), f"{what}: {code.name} naming {words} ({got}: {msg})")


def test_errors(cli, ch, hout):
    # registration
    expect(lambda: cli.register_system_shared_memory("x1", "/moed_no_such_object_x", 64), C.NOT_FOUND,
           ["key", "/moed_no_such_object_x"], "register an object that does not exist")
    expect(lambda: cli.register_system_shared_memory("x1", "a/b", 64), C.INVALID_ARGUMENT, ["key"],
           "register a key with a '/' inside")
    expect(lambda: cli.register_system_shared_memory("bad name", KEY + "_out", 64), C.INVALID_ARGUMENT, ["name"],
           "register a name with a space")
    expect(lambda: cli.register_system_shared_memory("x1", KEY + "_out", 64, offset=(1 << 20) - 32),
           C.INVALID_ARGUMENT, ["offset + byte_size", "past the end"], "register past the object's end")
    expect(lambda: cli.register_system_shared_memory("x1", KEY + "_out", 2 ** 63, offset=2 ** 64 - 2 ** 62),
           C.INVALID_ARGUMENT, ["offset + byte_size"], "register offset + byte_size that overflows")
    expect(lambda: cli.register_system_shared_memory("x1", KEY + "_out", 0), C.INVALID_ARGUMENT, ["byte_size"],
           "register 0 bytes")
    expect(lambda: cli.register_system_shared_memory("out", KEY + "_out", 64), C.ALREADY_EXISTS, ["name", "out"],
           "register a name twice")
    # status
    st = cli.get_system_shared_memory_status()
    regions = {k: (v.key, v.offset, v.byte_size) for k, v in st.regions.items()}
    check(regions == {"in": (KEY + "_in", 0, 1 << 20), "out": (KEY + "_out", 0, 1 << 20)},
          f"status lists both regions with key, offset, byte_size ({regions})")
    one = cli.get_system_shared_memory_status("out")
    check(list(one.regions) == ["out"], "status of one region")
    expect(lambda: cli.get_system_shared_memory_status("nope"), C.NOT_FOUND, ["nope"], "status of an unknown region")
    # inference
    x = np.ones((2, 64), np.float32)

    def infer_with(region="in", size=x.nbytes, offset=0, out=None):
        i = tc.InferInput("x", [2, 64], "FP32")
        i.set_shared_memory(region, size, offset=offset)
        return lambda: cli.infer("quant.per_token", [i], outputs=out, parameters={"out_dtype": "int8"})

    expect(infer_with(region="nope"), C.NOT_FOUND, ["inputs[0] 'x'", "shared_memory_region", "nope"],
           "infer naming an unknown region")
    expect(infer_with(offset=(1 << 20) - 64), C.INVALID_ARGUMENT, ["inputs[0] 'x'", "past the end"],
           "infer with an input past the region's end")
    expect(infer_with(size=x.nbytes - 4), C.INVALID_ARGUMENT, ["inputs[0] 'x'", "shared_memory_byte_size"],
           "infer whose byte size differs from shape x dtype")
    o = tc.InferRequestedOutput("q")
    o.set_shared_memory("out", 100)
    expect(infer_with(out=[o]), C.INVALID_ARGUMENT, ["outputs[0] 'q'", "shared_memory_byte_size", "128"],
           "an output region too small")
    o = tc.InferRequestedOutput("q")
    o.set_shared_memory("out", 128, offset=(1 << 20) - 64)
    expect(infer_with(out=[o]), C.INVALID_ARGUMENT, ["outputs[0] 'q'", "past the end"], "an output past the end")
    req = pb.ModelInferRequest(model_name="quant.per_token")
    t = req.inputs.add()
    t.name, t.datatype = "x", "FP32"
    t.shape.extend([2, 64])
    t.parameters["shared_memory_region"].string_param = "in"
    expect(lambda: infer_pb(ch, req), C.INVALID_ARGUMENT, ["shared_memory_byte_size", "required"],
           "a region without its byte size")
    t.parameters["shared_memory_byte_size"].string_param = "512"
    expect(lambda: infer_pb(ch, req), C.INVALID_ARGUMENT, ["shared_memory_byte_size", "integer"],
           "a byte size that is a string")
    test_cuda_refused(cli, ch)
    # a client that shrinks its object under a registered region: the copy's
    # fault is that request's error, the server goes on
    h = region("tr", 1 << 18, "_tr")
    try:
        cli.register_system_shared_memory("tr", KEY + "_tr", 1 << 18)
        os.truncate("/dev/shm/" + (KEY + "_tr").lstrip("/"), 0)
        expect(infer_with(region="tr"), C.INVALID_ARGUMENT, ["inputs[0] 'x'", "no longer backed"],
               "an input region whose object was truncated (small input)")
        big = tc.InferInput("x", [512, 128], "FP32")
        big.set_shared_memory("tr", 512 * 128 * 4)
        expect(lambda: cli.infer("quant.per_token", [big], parameters={"out_dtype": "int8"}), C.INVALID_ARGUMENT,
               ["inputs[0] 'x'", "no longer backed"], "an input region whose object was truncated (copied on a worker)")
        o = tc.InferRequestedOutput("q")
        o.set_shared_memory("tr", 128)
        expect(infer_with(out=[o]), C.INVALID_ARGUMENT, ["outputs[0] 'q'", "no longer backed"],
               "an output region whose object was truncated")
        check(cli.is_server_live(), "the server lives on")
        cli.unregister_system_shared_memory("tr")
    finally:
        shm.destroy_shared_memory_region(h)
    # unregister one, then all; an unknown name is no error (Triton's rule)
    cli.register_system_shared_memory("extra", KEY + "_out", 64, offset=4096)
    cli.unregister_system_shared_memory("extra")
    check("extra" not in cli.get_system_shared_memory_status().regions, "unregister one region")
    check(code_of(lambda: cli.unregister_system_shared_memory("never"))[0] == C.OK, "unregister an unknown name: OK")


def b64(raw):
    """A raw handle as tritonclient takes it (base64; its gRPC client decodes it)."""
    return base64.b64encode(raw)


def cuda_unavailable():
    """The status and words a well-formed CudaSharedMemoryRegister gets from
    this moed, which opens no CUDA IPC handle: a build without a GPU backend
    (the op library says so) UNIMPLEMENTED, a GPU build on a machine without
    a GPU FAILED_PRECONDITION (tests/gpu/cudashm.sh covers one with). The
    build is moed's own (MOED_GPU_BACKEND from CMake), not MOE_LIB's: a
    sanitizer build's MOE_LIB is a plain build's library, which can have a
    GPU backend where the sanitized moed has none."""
    gpu = os.environ.get("MOED_GPU_BACKEND")
    if gpu is None:  # run by hand: the library's answer
        gpu = "CUDA" if ctypes.CDLL(os.environ["MOE_LIB"]).moe_ipc_supported() else "none"
    if gpu == "none":
        return C.UNIMPLEMENTED, ["no GPU backend", "SystemSharedMemoryRegister"]
    return C.FAILED_PRECONDITION, ["device_id", "no GPU"]


def test_cuda_refused(cli, ch):
    """CUDA shared memory on a moed that opens no CUDA IPC handle: each field
    checked first and named, then the precise refusal; the system regions
    (one registry, one namespace) untouched by the CUDA methods."""
    h = b"\1" * 64
    expect(lambda: cli.register_cuda_shared_memory("g", b64(h[:63]), 0, 64), C.INVALID_ARGUMENT,
           ["raw_handle", "63 bytes", "64"], "CUDA register: a handle of 63 bytes")
    req = pb.CudaSharedMemoryRegisterRequest(name="g", device_id=0, byte_size=64)  # no handle at all
    expect(lambda: ch.unary_unary("/inference.GRPCInferenceService/CudaSharedMemoryRegister",
                                  request_serializer=pb.CudaSharedMemoryRegisterRequest.SerializeToString,
                                  response_deserializer=pb.CudaSharedMemoryRegisterResponse.FromString)(req),
           C.INVALID_ARGUMENT, ["raw_handle", "0 bytes"], "CUDA register: no handle")
    expect(lambda: cli.register_cuda_shared_memory("g", b64(h), 0, 0), C.INVALID_ARGUMENT, ["byte_size"],
           "CUDA register: 0 bytes")
    expect(lambda: cli.register_cuda_shared_memory("bad name", b64(h), 0, 64), C.INVALID_ARGUMENT, ["name"],
           "CUDA register: a name with a space")
    expect(lambda: cli.register_cuda_shared_memory("in", b64(h), 0, 64), C.ALREADY_EXISTS, ["name", "in"],
           "CUDA register: a system region's name (one namespace)")
    code, words = cuda_unavailable()
    expect(lambda: cli.register_cuda_shared_memory("g", b64(h), 0, 64), code, words,
           "CUDA register: a well-formed request, no GPU to open it on")
    check(len(cli.get_cuda_shared_memory_status().regions) == 0, "CudaSharedMemoryStatus: no regions")
    expect(lambda: cli.get_cuda_shared_memory_status("in"), C.NOT_FOUND, ["CUDA", "in"],
           "CudaSharedMemoryStatus of a system region's name: not a CUDA region")
    check(code_of(lambda: cli.unregister_cuda_shared_memory())[0] == C.OK, "CudaSharedMemoryUnregister: nothing to do")
    check(code_of(lambda: cli.unregister_cuda_shared_memory("in"))[0] == C.OK,
          "CudaSharedMemoryUnregister of a system region's name: OK ...")
    check(set(cli.get_system_shared_memory_status().regions) == {"in", "out"},
          "... and the system regions are all still registered")
    check("cuda_shared_memory" not in cli.get_server_metadata().extensions,
          "ServerMetadata does not list cuda_shared_memory")


def test_expert_set(cli, ch):
    """fused_moe on an expert set (moe-mkset, bf16, H=128, E=8): activations
    and router logits from a region, the output into one, bit-equal to raw;
    three requests sent at once (the batcher may merge them: each output is
    then split back into its own span)."""
    H, E = 128, 8
    rng = np.random.default_rng(11)
    hin, hout = region("set_in", 1 << 16, "_set_in"), region("set_out", 1 << 16, "_set_out")
    try:
        cli.register_system_shared_memory("set_in", KEY + "_set_in", 1 << 16)
        cli.register_system_shared_memory("set_out", KEY + "_set_out", 1 << 16)
        calls = []
        for k, T in enumerate((3, 5, 7)):
            h = ts.bf16(rng.standard_normal((T, H)))
            lg = rng.standard_normal((T, E)).astype(np.float32)
            ref = infer_pb(ch, make_req("set", [("hidden_states", "BF16", [T, H], h.tobytes()),
                                                ("router_logits", "FP32", [T, E], lg.tobytes())]))
            base = k * 8192
            shm.set_shared_memory_region(hin, [h], offset=base)
            shm.set_shared_memory_region(hin, [lg], offset=base + 4096)
            ih, il = tc.InferInput("hidden_states", [T, H], "BF16"), tc.InferInput("router_logits", [T, E], "FP32")
            ih.set_shared_memory("set_in", h.nbytes, offset=base)
            il.set_shared_memory("set_in", lg.nbytes, offset=base + 4096)
            o = tc.InferRequestedOutput("output")
            o.set_shared_memory("set_out", 4096, offset=base)
            calls.append((ih, il, o, base, ref.raw_output_contents[0]))
        results = [None] * len(calls)
        for k, (ih, il, o, _, _) in enumerate(calls):
            cli.async_infer("set", [ih, il], lambda result, error, k=k: results.__setitem__(k, error or result), outputs=[o])
        for _ in range(200):
            if all(r is not None for r in results):
                break
            time.sleep(0.05)
        ok = all(isinstance(r, tc.InferResult) for r in results)
        check(ok, f"expert set: three requests through shared memory answered ({results})")
        for k, (_, _, _, base, want) in enumerate(calls):
            got = shm.get_contents_as_numpy(hout, np.uint8, [len(want)], offset=base).tobytes()
            check(got == want, f"expert set: request {k} output bit-equal to raw ({len(want)} bytes)")
    finally:
        cli.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(hin)
        shm.destroy_shared_memory_region(hout)


def test_limit(cli):
    h = region("lim", 4096, "_lim")
    try:
        for k in range(3):
            cli.register_system_shared_memory(f"r{k}", KEY + "_lim", 64, offset=64 * k)
        expect(lambda: cli.register_system_shared_memory("r3", KEY + "_lim", 64), C.RESOURCE_EXHAUSTED,
               ["--shm-max-regions"], "a fourth region over --shm-max-regions 3")
        cli.unregister_system_shared_memory()
        check(len(cli.get_system_shared_memory_status().regions) == 0, "unregister all: status empty")
        cli.register_system_shared_memory("r3", KEY + "_lim", 64)
        check(list(cli.get_system_shared_memory_status().regions) == ["r3"], "room again after unregistering")
        cli.unregister_system_shared_memory()
    finally:
        shm.destroy_shared_memory_region(h)


def test_rest(rest_port, ch):
    """The same through the KServe REST API and tritonclient.http."""
    cli = th.InferenceServerClient(f"127.0.0.1:{rest_port}")
    x = np.random.default_rng(5).standard_normal((16, 64)).astype(np.float32)
    ref = infer_pb(ch, make_req("quant.mx", [("x", "FP32", [16, 64], x.tobytes())], {"format": "mxfp4"}))
    ro = {o.name: ref.raw_output_contents[k] for k, o in enumerate(ref.outputs)}
    hin, hout = region("rin", x.nbytes, "_rin"), region("rout", 4096, "_rout")
    try:
        shm.set_shared_memory_region(hin, [x])
        cli.register_system_shared_memory("rin", KEY + "_rin", x.nbytes)
        cli.register_system_shared_memory("rout", KEY + "_rout", 4096)
        st = cli.get_system_shared_memory_status()
        got = sorted((e["name"], e["key"], e["offset"], e["byte_size"]) for e in st)
        check(got == [("rin", KEY + "_rin", 0, x.nbytes), ("rout", KEY + "_rout", 0, 4096)],
              f"REST status: a list of the regions ({got})")
        i = th.InferInput("x", [16, 64], "FP32")
        i.set_shared_memory("rin", x.nbytes)
        oq, osc = th.InferRequestedOutput("q"), th.InferRequestedOutput("scales")
        oq.set_shared_memory("rout", 1024, offset=64)
        res = cli.infer("quant.mx", [i], outputs=[oq, osc], parameters={"format": "mxfp4"})
        q = shm.get_contents_as_numpy(hout, np.uint8, [len(ro["q"])], offset=64).tobytes()
        check(q == ro["q"] and res.as_numpy("scales").tobytes() == ro["scales"],
              "REST: input from and q into shared memory, scales binary: bit-equal to gRPC raw")
        out = res.get_output("q")
        check(out is not None and out["shape"] == [16, 32] and "data" not in out
              and "binary_data_size" not in out.get("parameters", {}),
              f"REST: the shared-memory output has its metadata and no data ({out})")
        expect_http(lambda: cli.register_system_shared_memory("rin", KEY + "_rin", 64), 409, "name",
                    "REST register a name twice")
        expect_http(lambda: cli.register_system_shared_memory("zz", "/moed_no_such_object_x", 64), 404, "key",
                    "REST register a missing object")
        i.set_shared_memory("nope", x.nbytes)
        expect_http(lambda: cli.infer("quant.mx", [i], parameters={"format": "mxfp4"}), 404,
                    "shared_memory_region", "REST infer naming an unknown region")
        cli.unregister_system_shared_memory("rin")
        check([e["name"] for e in cli.get_system_shared_memory_status()] == ["rout"], "REST unregister one")
        check(cli.get_cuda_shared_memory_status() == [], "REST CUDA status: none")
        h = base64.b64encode(b"\1" * 64).decode()
        expect_http(lambda: cli.register_cuda_shared_memory("g", h[:-4], 0, 64), 400, "raw_handle",
                    "REST CUDA register: a handle of 63 bytes")
        expect_http(lambda: cli.register_cuda_shared_memory("g", "not base64!", 0, 64), 400, "raw_handle",
                    "REST CUDA register: a handle that is not base64")
        expect_http(lambda: cli.register_cuda_shared_memory("g", h, -1, 64), 400, "device_id",
                    "REST CUDA register: a negative device_id")
        expect_http(lambda: cli.register_cuda_shared_memory("g", h, 0, 0), 400, "byte_size",
                    "REST CUDA register: 0 bytes")
        code, words = cuda_unavailable()
        expect_http(lambda: cli.register_cuda_shared_memory("g", h, 0, 64),
                    501 if code == C.UNIMPLEMENTED else 400, words[0], "REST CUDA register: no GPU to open it on")
        cli.unregister_system_shared_memory()
        check(cli.get_system_shared_memory_status() == [], "REST unregister all")
    finally:
        shm.destroy_shared_memory_region(hin)
        shm.destroy_shared_memory_region(hout)


def expect_http(fn, status, word, what):
    try:
        fn()
        got, msg = 200, ""
    except Exception as e:  # tritonclient.utils.InferenceServerException
        got, msg = getattr(e, "status", lambda: None)(), str(e)
    check(str(got) == str(status) and word in msg, f"{what}: {status} naming {word} ({got}: {msg})")


def test_in_use(tmp):
    """Requests held 1.5 s in an open batch (--max-queue-delay-us) use a
    region for a large input (copied on the worker) and one for the output;
    both regions are unregistered meanwhile: the requests still succeed
    through the old mappings, a new one naming the region gets NOT_FOUND."""
    with moed(tmp, "--max-queue-delay-us", "1500000") as (_, port, _):
        cli = tc.InferenceServerClient(f"127.0.0.1:{port}")
        x = np.random.default_rng(3).standard_normal((256, 128)).astype(np.float32)  # 128 KiB
        ref = cli.infer("quant.per_token", [_raw("x", x)], parameters={"out_dtype": "int8"}).get_response()
        hin, hout = region("in", x.nbytes, "_use_in"), region("out", 1 << 16, "_use_out")
        try:
            shm.set_shared_memory_region(hin, [x])
            cli.register_system_shared_memory("in", KEY + "_use_in", x.nbytes)
            cli.register_system_shared_memory("out", KEY + "_use_out", 1 << 16)
            results = []

            def call(k):
                i = tc.InferInput("x", list(x.shape), "FP32")
                i.set_shared_memory("in", x.nbytes)
                o = tc.InferRequestedOutput("q")
                o.set_shared_memory("out", x.size, offset=0 if k == 0 else 1 << 15)
                results.append(code_of(lambda: cli.infer("quant.per_token", [i], outputs=[o],
                                                         parameters={"out_dtype": "int8"})))

            th = [threading.Thread(target=call, args=(k,)) for k in range(2)]
            for t in th:
                t.start()
            time.sleep(0.5)  # both held in the batch
            cli.unregister_system_shared_memory()
            check(len(cli.get_system_shared_memory_status().regions) == 0, "unregistered while in use")
            for t in th:
                t.join()
            check(results == [(C.OK, "")] * 2, f"requests in flight finish through the old mappings ({results})")
            for off in (0, 1 << 15):
                got = shm.get_contents_as_numpy(hout, np.uint8, [x.size], offset=off).tobytes()
                check(got == ref.raw_output_contents[0], f"output at offset {off} written after unregister")
            i = tc.InferInput("x", list(x.shape), "FP32")
            i.set_shared_memory("in", x.nbytes)
            expect(lambda: cli.infer("quant.per_token", [i], parameters={"out_dtype": "int8"}), C.NOT_FOUND,
                   ["shared_memory_region", "in"], "a new request naming the unregistered region")
        finally:
            shm.destroy_shared_memory_region(hin)
            shm.destroy_shared_memory_region(hout)


def test_auth(tmp):
    """--auth-tokens: an infer token may register, use and unregister a region; no token may not."""
    tokens = os.path.join(tmp, "tokens")
    with open(tokens, "w") as f:
        f.write("client infer 0123456789abcdef0123456789abcdef\n")
    with moed(tmp, "--auth-tokens", tokens) as (_, port, _):
        h = region("auth", 4096, "_auth")
        try:
            cli = tc.InferenceServerClient(f"127.0.0.1:{port}")
            hdr = {"authorization": "Bearer 0123456789abcdef0123456789abcdef"}
            expect(lambda: cli.register_system_shared_memory("a", KEY + "_auth", 4096), C.UNAUTHENTICATED,
                   ["authorization"], "auth: register without a token")
            cli.register_system_shared_memory("a", KEY + "_auth", 4096, headers=hdr)
            x = np.ones((2, 64), np.float32)
            shm.set_shared_memory_region(h, [x])
            i = tc.InferInput("x", [2, 64], "FP32")
            i.set_shared_memory("a", x.nbytes)
            res = cli.infer("quant.per_token", [i], parameters={"out_dtype": "int8"}, headers=hdr)
            check(res.as_numpy("q").shape == (2, 64), "auth: an infer token registers and infers from a region")
            expect(lambda: cli.get_system_shared_memory_status(), C.UNAUTHENTICATED, ["authorization"],
                   "auth: status without a token")
            cli.unregister_system_shared_memory(headers=hdr)
            check(len(cli.get_system_shared_memory_status(headers=hdr).regions) == 0,
                  "auth: an infer token unregisters")
        finally:
            shm.destroy_shared_memory_region(h)


def test_off(tmp):
    with moed(tmp, "--shm-max-regions", "0") as (_, port, _):
        cli = tc.InferenceServerClient(f"127.0.0.1:{port}")
        check("system_shared_memory" not in cli.get_server_metadata().extensions, "off: extension not listed")
        expect(lambda: cli.register_system_shared_memory("a", KEY + "_x", 64), C.FAILED_PRECONDITION,
               ["--shm-max-regions 0"], "off: register refused naming the flag")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        repo = os.path.join(tmp, "repo")
        subprocess.run([os.environ["MOE_MKSET"], "--out", f"{repo}/set", "--scheme", "bf16", "--experts", "8",
                        "--hidden", "128", "--intermediate", "64", "--top-k", "2"], check=True, capture_output=True)
        # a 20 ms batch window, for the expert set's three requests to meet in
        with moed(tmp, "--shm-max-regions", "3", "--model-repository", repo, "--max-queue-delay-us",
                  "20000") as (p, port, _):
            target = f"127.0.0.1:{port}"
            cli = tc.InferenceServerClient(target)
            ch = grpc.insecure_channel(target)
            check("system_shared_memory" in cli.get_server_metadata().extensions,
                  "ServerMetadata lists system_shared_memory")
            test_ops(cli, ch)
            test_expert_set(cli, ch)
            test_limit(cli)
            test_rest(p.rest_port, ch)
        test_in_use(tmp)
        test_auth(tmp)
        test_off(tmp)
        print_log_tail(tmp)
    exit_with_summary()


if __name__ == "__main__":
    main()
