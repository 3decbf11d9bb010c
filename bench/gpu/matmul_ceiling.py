"""Matrix-product ceilings (BENCH.md): 8192^3 through torch, random data,
median of 20 timed products after 3 warm-ups, events. bf16 (a @ b), and
fp8 e4m3 x e4m3 -> bf16 (torch._scaled_mm, unit scales: cuBLAS's fp8
GEMM, the rate fp8 W8A8's fused_moe is compared with)."""
import torch

n = 8192


def median_ms(f):
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        f()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def report(what, ms):
    print(f"ceiling: {what} matmul 8192^3 (torch {torch.__version__}): {ms:.3f} ms, "
          f"{2 * n**3 / (ms * 1e-3) / 1e12:.1f} TFLOP/s")


a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
report("bf16", median_ms(lambda: a @ b))

try:
    a8 = a.to(torch.float8_e4m3fn)
    b8 = b.to(torch.float8_e4m3fn).t().contiguous().t()  # column-major: cuBLAS's fp8 layout
    one = torch.ones((), device="cuda", dtype=torch.float32)
    report("fp8 e4m3", median_ms(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one,
                                                          out_dtype=torch.bfloat16)))
except (AttributeError, RuntimeError) as ex:  # no fp8 GEMM in this torch or on this device
    print(f"ceiling: fp8 e4m3 matmul unavailable: {ex}")
