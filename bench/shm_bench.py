"""System shared memory against raw contents, as a tritonclient caller on
the same node sees it: one large request (quant.per_token, [T, H] BF16 ->
fp8, default [4096, 7168]) and one small one (quant.per_tensor [4, 64]
FP32 -> int8), each sent with its tensors in the message and then in
POSIX shared memory; outputs checked bit-equal, wall times per call.

usage: .venv/bin/python bench/shm_bench.py HOST:PORT [T H [REPEATS]]"""
import sys
import time

import ml_dtypes
import numpy as np
import tritonclient.grpc as g
import tritonclient.utils.shared_memory as shm


def timed(f, n):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return np.median(ts), np.percentile(ts, 90)


def main():
    addr = sys.argv[1]
    T, H = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (4096, 7168)
    reps = int(sys.argv[4]) if len(sys.argv) > 4 else 8
    c = g.InferenceServerClient(addr, verbose=False)
    x = np.random.default_rng(0).standard_normal((T, H)).astype(ml_dtypes.bfloat16)
    p = {"out_dtype": "fp8_e4m3fn"}
    out_bytes = T * H + T * 4
    hin = shm.create_shared_memory_region("bench_in", "/moed_bench_in", x.nbytes)
    hout = shm.create_shared_memory_region("bench_out", "/moed_bench_out", out_bytes + 64)
    try:
        shm.set_shared_memory_region(hin, [x.view(np.uint16)])
        c.register_system_shared_memory("bench_in", "/moed_bench_in", x.nbytes)
        c.register_system_shared_memory("bench_out", "/moed_bench_out", out_bytes + 64)
        raw_in = g.InferInput("x", [T, H], "BF16")
        raw_in.set_data_from_numpy(x)
        shm_in = g.InferInput("x", [T, H], "BF16")
        shm_in.set_shared_memory("bench_in", x.nbytes)
        oq, osc = g.InferRequestedOutput("q"), g.InferRequestedOutput("scales")
        oq.set_shared_memory("bench_out", T * H)
        osc.set_shared_memory("bench_out", T * 4, offset=T * H)

        def raw():
            return c.infer("quant.per_token", [raw_in], parameters=p)

        def via_shm():
            return c.infer("quant.per_token", [shm_in], outputs=[oq, osc], parameters=p)

        ref = raw().as_numpy("q").tobytes()
        via_shm()
        same = shm.get_contents_as_numpy(hout, np.uint8, [T * H]).tobytes() == ref
        print(f"quant.per_token [{T}, {H}] BF16 -> fp8 ({x.nbytes / 2**20:.1f} MiB in): shm output bit-equal {same}")
        for name, f in (("raw", raw), ("shm", via_shm)) * 2:
            med, p90 = timed(f, reps)
            print(f"  {name}: median {med * 1e3:8.1f} ms  p90 {p90 * 1e3:8.1f} ms  {x.nbytes / med / 1e9:5.2f} GB/s in")
        small = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
        shm.set_shared_memory_region(hin, [small])
        si, ri = g.InferInput("x", [4, 64], "FP32"), g.InferInput("x", [4, 64], "FP32")
        si.set_shared_memory("bench_in", small.nbytes)
        ri.set_data_from_numpy(small)
        so = g.InferRequestedOutput("q")
        so.set_shared_memory("bench_out", 256)
        q8 = {"out_dtype": "int8"}
        print("quant.per_tensor [4, 64] FP32 -> int8 (1 KiB in):")
        for name, f in ((("raw", lambda: c.infer("quant.per_tensor", [ri], parameters=q8)),
                         ("shm", lambda: c.infer("quant.per_tensor", [si], outputs=[so], parameters=q8))) * 2):
            med, p90 = timed(f, 300)
            print(f"  {name}: median {med * 1e6:8.0f} us  p90 {p90 * 1e6:8.0f} us")
    finally:
        c.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(hin)
        shm.destroy_shared_memory_region(hout)


if __name__ == "__main__":
    main()
