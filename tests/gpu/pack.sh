#!/usr/bin/env bash
# Builds the GPU machine's binaries here (CMake build dir, default build/)
# and packs them for a GPU machine that has none of the build's packages
# (Check, cJSON, gRPC, protobuf-c, libuv, ...): the stripped binaries in
# .gpu/bin.tar.xz (xz: the sm_90a kernels make each binary ~33 MB) and the
# shared libraries ldd lists (less libc, libm, libstdc++, libgcc_s) in
# .gpu/lib. Always test_gpu and moe-bench-gpu; with the server in the build
# (MOE_BUILD_SERVER, the default) also moed, moec, moe-mkset and
# moe-echo-server. There: tests/gpu/run.sh LOGDIR .gpu, tests/gpu/moed_load.sh .gpu LOGDIR
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$ROOT/build}
targets=(test_gpu moe-bench-gpu)
paths=(tests/gpu/test_gpu bench/gpu/moe-bench-gpu)
if grep -q '^MOE_BUILD_SERVER:BOOL=ON' "$BUILD/CMakeCache.txt"; then
  targets+=(moed moec moe-mkset moe-echo-server)
  paths+=(server/moed client/moec tools/moe-mkset bench/moe-echo-server)
fi
cmake --build "$BUILD" -j"$(nproc)" --target "${targets[@]}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for p in "${paths[@]}"; do cp "$BUILD/$p" "$tmp/"; done
(cd "$tmp" && strip "${targets[@]}")
rm -rf "$ROOT/.gpu"
mkdir -p "$ROOT/.gpu/lib"
tar cf - -C "$tmp" "${targets[@]}" | xz -T"$(nproc)" -6 >"$ROOT/.gpu/bin.tar.xz"
(cd "$tmp" && ldd "${targets[@]}") | awk '/=>/ {print $3}' | sort -u |
  grep -vE '/(libc|libm|libstdc\+\+|libgcc_s|ld-linux)[.-]' | xargs -r -I{} cp -L {} "$ROOT/.gpu/lib/"
du -sh "$ROOT/.gpu"
