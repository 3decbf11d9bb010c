"""bf16 matrix-product ceiling (BENCH.md): 8192^3 through torch, random data,
median of 20 timed products after 3 warm-ups, events."""
import torch

n = 8192
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    a @ b
torch.cuda.synchronize()
times = []
for _ in range(20):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    a @ b
    e.record()
    e.synchronize()
    times.append(s.elapsed_time(e))
times.sort()
ms = times[len(times) // 2]
print(f"ceiling: bf16 matmul 8192^3 (torch {torch.__version__}): {ms:.3f} ms, {2 * n**3 / (ms * 1e-3) / 1e12:.1f} TFLOP/s")
