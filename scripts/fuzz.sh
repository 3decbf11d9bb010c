#!/usr/bin/env bash
# libFuzzer over moed's decoders of untrusted bytes (fuzz/): builds the
# targets with clang (build-fuzz/, MOE_FUZZ=ON: ASan + UBSan, every target
# instrumented), replays every kept regression input (fuzz/regressions/),
# then fuzzes each target for SECONDS (default 30) from its seed corpus
# (fuzz/corpus/<target>/, copied: new inputs stay out of the tree). A crash
# fails the script and leaves its input in build-fuzz/crashes/; fix it and
# keep the input in fuzz/regressions/<target>/.
#   scripts/fuzz.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-30}
build="build-fuzz"
if [ ! -f "$build/CMakeCache.txt" ]; then
  CC=clang CXX=clang++ cmake -S . -B "$build" -DMOE_GPU=OFF -DMOE_FUZZ=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
fi
targets=(infer_request rest_infer http_conn upload safetensors expert_config)
cmake --build "$build" -j2 --target "${targets[@]/#/fuzz_}" >/dev/null
mkdir -p "$build/crashes"
# leaks: the fuzzers' one-time state (gRPC, the repository) lives until exit
export ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
for t in "${targets[@]}"; do
  bin="$build/fuzz/fuzz_$t"
  if [ -d "fuzz/regressions/$t" ] && [ -n "$(ls -A "fuzz/regressions/$t")" ]; then
    "$bin" "fuzz/regressions/$t"/* >"$build/crashes/$t.regressions.log" 2>&1 ||
      { echo "fuzz: $t: a kept regression input fails again ($build/crashes/$t.regressions.log)" >&2; exit 1; }
  fi
  work=$(mktemp -d)
  cp -r "fuzz/corpus/$t/." "$work/"
  if ! "$bin" -max_total_time="$seconds" -max_len=65536 -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
      -artifact_prefix="$build/crashes/$t-" "$work" >"$build/crashes/$t.log" 2>&1; then
    echo "fuzz: $t found a crash: see $build/crashes/$t.log (the input: $build/crashes/$t-*)" >&2
    rm -rf "$work"
    exit 1
  fi
  echo "fuzz: $t: $(grep -o 'stat::number_of_executed_units: [0-9]*' "$build/crashes/$t.log" | awk '{print $2}') runs in ${seconds}s, corpus $(find "$work" -type f | wc -l) inputs, no crash"
  rm -rf "$work"
done
