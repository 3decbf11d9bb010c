#!/usr/bin/env bash
# Builds test_gpu and moe-bench-gpu here (CMake build dir, default build/)
# and packs them for a GPU machine that has no Check or cJSON: the stripped
# binaries in .gpu/bin.tar.xz (xz: the sm_90a kernels make each binary
# ~33 MB) and the shared libraries ldd lists (less libc, libm, libstdc++,
# libgcc_s) in .gpu/lib. There: tests/gpu/run.sh LOGDIR .gpu
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$ROOT/build}
cmake --build "$BUILD" -j"$(nproc)" --target test_gpu moe-bench-gpu
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp "$BUILD/tests/gpu/test_gpu" "$BUILD/bench/gpu/moe-bench-gpu" "$tmp/"
strip "$tmp/test_gpu" "$tmp/moe-bench-gpu"
rm -rf "$ROOT/.gpu"
mkdir -p "$ROOT/.gpu/lib"
tar cf - -C "$tmp" test_gpu moe-bench-gpu | xz -T"$(nproc)" -6 >"$ROOT/.gpu/bin.tar.xz"
ldd "$tmp/test_gpu" "$tmp/moe-bench-gpu" | awk '/=>/ {print $3}' | sort -u |
  grep -vE '/(libc|libm|libstdc\+\+|libgcc_s|ld-linux)[.-]' | xargs -r -I{} cp -L {} "$ROOT/.gpu/lib/"
du -sh "$ROOT/.gpu"
