#!/usr/bin/env bash
# ThreadSanitizer over moed's threads: moed, moec and moe-mkset built with
# -fsanitize=thread (build-tsan/, MOE_TSAN=ON), then the integration tests
# that drive the CQ thread, the loop, the device workers, the batcher and
# the upload thread pool at once. A data race stops moed at once
# (halt_on_error), which fails the test that was running. The Python side
# loads a plain libmoe (a TSan library cannot be loaded into Python):
# build-tsan-oracle/, or MOE_LIB if set.
#   scripts/tsan.sh [TEST...]     (default: test_server test_fused_moe test_stream_memory test_stop)
set -euo pipefail
cd "$(dirname "$0")/.."
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(test_server test_fused_moe test_stream_memory test_stop)
if [ ! -f build-tsan/CMakeCache.txt ]; then
  cmake -S . -B build-tsan -DMOE_GPU=OFF -DMOE_TSAN=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
fi
cmake --build build-tsan -j2 --target moed moec moe-mkset >/dev/null
if [ -z "${MOE_LIB:-}" ]; then
  if [ ! -f build-tsan-oracle/CMakeCache.txt ]; then
    cmake -S . -B build-tsan-oracle -DMOE_GPU=OFF -DMOE_BUILD_SERVER=OFF >/dev/null
  fi
  cmake --build build-tsan-oracle -j2 --target moe_shared >/dev/null
  MOE_LIB=$(ls build-tsan-oracle/kernels/libmoe.so)
fi
export MOE_LIB MOED=build-tsan/server/moed MOEC=build-tsan/client/moec MOE_MKSET=build-tsan/tools/moe-mkset
export MOE_SANITIZED=1 PYTHONUNBUFFERED=1
# libgomp is not instrumented: one OpenMP thread per worker (the default on
# two cores) keeps its barriers from looking like races
export OMP_NUM_THREADS=1
# history_size=7: the older access of a report keeps its stack, which the
# suppressions (scripts/tsan.supp, each with its reason) match against
export TSAN_OPTIONS="halt_on_error=1 exitcode=66 second_deadlock_stack=1 history_size=7 suppressions=$PWD/scripts/tsan.supp"
fail=0
for t in "${tests[@]}"; do
  start=$(date +%s)
  if .venv/bin/python "tests/integration/$t.py" >"build-tsan/$t.log" 2>&1; then
    echo "tsan: $t: no race ($(($(date +%s) - start)) s)"
  else
    echo "tsan: $t failed ($(($(date +%s) - start)) s): build-tsan/$t.log" >&2
    grep -m1 -A30 "WARNING: ThreadSanitizer" "build-tsan/$t.log" >&2 || tail -20 "build-tsan/$t.log" >&2
    fail=1
  fi
done
exit $fail
