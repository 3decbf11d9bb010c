#!/usr/bin/env bash
# One command on a GPU machine: the GPU-vs-CPU test (full), the same test
# under compute-sanitizer memcheck (quick mode), the quant bench and the
# bf16 and fp8 matmul ceilings, the fused_moe bench. Every log goes to LOGDIR; a summary to stdout.
#   tests/gpu/run.sh LOGDIR            build here (CMake, nvcc, Check) and run
#   tests/gpu/run.sh LOGDIR BINDIR     run prebuilt test_gpu + moe-bench-gpu
#                                      (BINDIR/lib: shared libs they need;
#                                      BINDIR/bin.tar.xz: both binaries packed
#                                      by tests/gpu/pack.sh, unpacked here)
set -u
LOG=${1:?usage: tests/gpu/run.sh LOGDIR [BINDIR]}
BIN=${2:-}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$LOG"
if [ -z "$BIN" ]; then
  if ! { cmake -S "$ROOT" -B "$ROOT/build-gpu" -DCMAKE_BUILD_TYPE=Release -DMOE_BUILD_SERVER=OFF &&
         cmake --build "$ROOT/build-gpu" -j"$(nproc)" --target test_gpu moe-bench-gpu; } >"$LOG/build.log" 2>&1; then
    echo "build failed"; tail -30 "$LOG/build.log"; exit 1
  fi
  TEST=$ROOT/build-gpu/tests/gpu/test_gpu
  BENCH=$ROOT/build-gpu/bench/gpu/moe-bench-gpu
else
  BIN=$(cd "$BIN" && pwd)
  export LD_LIBRARY_PATH=$BIN/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  if [ -f "$BIN/bin.tar.xz" ]; then
    UNPACK=$(mktemp -d)
    python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$BIN/bin.tar.xz" "$UNPACK"
    chmod +x "$UNPACK"/*
    TEST=$UNPACK/test_gpu
    BENCH=$UNPACK/moe-bench-gpu
  else
    TEST=$BIN/test_gpu
    BENCH=$BIN/moe-bench-gpu
  fi
fi
rc=0
nvidia-smi >"$LOG/nvidia-smi.txt" 2>&1 && head -12 "$LOG/nvidia-smi.txt"

# Each run twice: the vendor fast path (default) and MOE_GPU_PORTABLE=1
# (codec.h conversions only), so both stay bit-exact with the CPU.
for path in fast portable; do
  if [ $path = portable ]; then export MOE_GPU_PORTABLE=1; else unset MOE_GPU_PORTABLE; fi
  echo "== test_gpu (full, $path path)"
  start=$(date +%s)
  "$TEST" >"$LOG/test-$path.log" 2>&1 || rc=1
  grep -E '^[0-9]+%|gpu vs cpu|skipped|differs|error' "$LOG/test-$path.log" | head -20
  echo "   ($(( $(date +%s) - start )) s)"
  echo "== compute-sanitizer memcheck (MOE_GPU_TEST_QUICK=1, $path path)"
  start=$(date +%s)
  MOE_GPU_TEST_QUICK=1 compute-sanitizer --tool memcheck --error-exitcode 99 "$TEST" >"$LOG/memcheck-$path.log" 2>&1 || rc=1
  grep -E '^[0-9]+%|ERROR SUMMARY|gpu vs cpu|differs' "$LOG/memcheck-$path.log" | head -10
  echo "   ($(( $(date +%s) - start )) s)"
done
unset MOE_GPU_PORTABLE

echo "== bench"
"$BENCH" >"$LOG/bench.log" 2>&1 || rc=1
echo "-- portable path (MOE_GPU_PORTABLE=1):" >>"$LOG/bench.log"
MOE_GPU_PORTABLE=1 "$BENCH" --runs 20 >>"$LOG/bench.log" 2>&1 || rc=1
python3 "$ROOT/bench/gpu/matmul_ceiling.py" >>"$LOG/bench.log" 2>&1 || rc=1
cat "$LOG/bench.log"
echo "== fused_moe bench"
ceiling() { grep "ceiling: $1 matmul" "$LOG/bench.log" | grep -o '[0-9.]* TFLOP/s' | grep -o '^[0-9.]*'; }
"$BENCH" --fused --matmul-tflops "$(ceiling bf16 || echo 0)" --fp8-matmul-tflops "$(ceiling 'fp8 e4m3' || echo 0)" \
  >"$LOG/bench-fused.log" 2>&1 || rc=1
cat "$LOG/bench-fused.log"
echo "== rc=$rc"
exit $rc
