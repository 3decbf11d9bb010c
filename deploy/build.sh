#!/usr/bin/env bash
# The one build recipe of the moed images: every Dockerfile under
# deploy/docker/ runs it, and CI runs it (deploy/check.sh --build) so the
# recipe is proven without a Docker daemon.
#
#   deploy/build.sh BACKEND [--deps] [--build-dir DIR] [--prefix DIR] [--jobs N] [--configure-only]
#
# BACKEND   cpu  (-DMOE_GPU=OFF)
#           cuda (-DMOE_GPU=CUDA: nvcc, sm_80 + sm_90 machine code, sm_90a for the
#                 tensor-core kernels, compute_90 PTX; MOE_CUDA_ARCH_FLAGS /
#                 MOE_CUDA_TC_ARCH_FLAGS override them)
#           hip  (-DMOE_GPU=HIP: hipcc, MOE_HIP_ARCHS, default "gfx90a;gfx942":
#                 MI200 and MI300; ROCm 6's hipcc, as in the AMD image. Debian 12's
#                 hipcc (ROCm 5.2) has no gfx942: MOE_HIP_ARCHS="gfx90a;gfx940" there)
# --deps            install the build packages first (apt-get; the same names on
#                   Debian 12 and Ubuntu 24.04; the GPU compilers come from the image)
# --build-dir DIR   CMake build directory (default build-deploy-BACKEND)
# --prefix DIR      where the result is staged (default BUILD_DIR/stage):
#                     bin/ moed, moec, moe-mkset, moe-bench-service
#                     lib/ every shared library they load that is not glibc's
#                          (nor the GPU runtime's, which the base image provides),
#                          so the runtime stage installs no packages by name and
#                          runs them with LD_LIBRARY_PATH=PREFIX/lib
# --jobs N          parallel compile jobs (default: nproc)
# --configure-only  stop after CMake's configure step (CI's check of the GPU
#                   variants' flags where the full compile is done elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

backend="${1:-}"
case "$backend" in
  cpu | cuda | hip) shift ;;
  -h | --help) usage; exit 0 ;;
  *) usage >&2; exit 2 ;;
esac
want_deps=0 configure_only=0 build_dir="" prefix="" jobs="$(nproc)"
while [ $# -gt 0 ]; do
  case "$1" in
    --deps) want_deps=1 ;;
    --configure-only) configure_only=1 ;;
    --build-dir) build_dir="$2"; shift ;;
    --prefix) prefix="$2"; shift ;;
    --jobs) jobs="$2"; shift ;;
    *) echo "deploy/build.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
build_dir="${build_dir:-build-deploy-$backend}"
prefix="${prefix:-$build_dir/stage}"

if [ "$want_deps" = 1 ]; then
  # What configuring and building moed needs (tests/ is configured too, so
  # Check). -dev names: stable across Debian 12 and Ubuntu 24.04.
  pkgs=(build-essential cmake pkg-config check libsubunit-dev
        libgrpc-dev protobuf-c-compiler libprotobuf-c-dev grpc-proto
        libuv1-dev libhttp-parser-dev libcjson-dev libxxhash-dev)
  bash scripts/apt-install.sh "${pkgs[@]}"
fi

cmake_args=(-DCMAKE_BUILD_TYPE=Release -DMOE_BUILD_SERVER=ON)
case "$backend" in
  cpu) cmake_args+=(-DMOE_GPU=OFF) ;;
  cuda)
    # nvcc is not on PATH in every CUDA image; CMake also looks in /usr/local/cuda/bin.
    cmake_args+=(-DMOE_GPU=CUDA)
    [ -n "${MOE_CUDA_ARCH_FLAGS:-}" ] && cmake_args+=("-DMOE_CUDA_ARCH_FLAGS=$MOE_CUDA_ARCH_FLAGS")
    [ -n "${MOE_CUDA_TC_ARCH_FLAGS:-}" ] && cmake_args+=("-DMOE_CUDA_TC_ARCH_FLAGS=$MOE_CUDA_TC_ARCH_FLAGS")
    ;;
  hip)
    # AMD's images keep hipcc in /opt/rocm/bin
    [ -d /opt/rocm/bin ] && export PATH="$PATH:/opt/rocm/bin"
    cmake_args+=(-DMOE_GPU=HIP "-DMOE_HIP_ARCHS=${MOE_HIP_ARCHS:-gfx90a;gfx942}")
    ;;
esac

cmake -S . -B "$build_dir" "${cmake_args[@]}"
gpu_built=$(sed -n 's/^MOE_GPU_BACKEND:INTERNAL=//p' "$build_dir/CMakeCache.txt")
want_gpu=$(case "$backend" in cpu) echo none ;; cuda) echo CUDA ;; hip) echo HIP ;; esac)
if [ "$gpu_built" != "$want_gpu" ]; then
  echo "deploy/build.sh: configured GPU backend '$gpu_built', wanted '$want_gpu'" >&2
  exit 1
fi
if [ "$configure_only" = 1 ]; then
  echo "deploy/build.sh: $backend configured in $build_dir (GPU backend: $gpu_built)"
  exit 0
fi

targets=(moed moec moe-mkset moe-bench-service)
cmake --build "$build_dir" -j"$jobs" --target "${targets[@]}"

rm -rf "$prefix"
mkdir -p "$prefix/bin" "$prefix/lib"
cp "$build_dir/server/moed" "$build_dir/client/moec" "$build_dir/tools/moe-mkset" \
  "$build_dir/bench/moe-bench-service" "$prefix/bin/"

# Bundle the shared libraries (gRPC, protobuf-c, libuv, http-parser, cJSON,
# xxhash, OpenMP, libstdc++, ...) from this build image: the runtime stage
# has the same distribution, so glibc is the base image's and everything else
# comes from here. The GPU runtime (libamdhip64 and what it loads) stays the
# ROCm base image's; CUDA's runtime is linked statically and libcuda comes
# from the driver (the NVIDIA container toolkit mounts it).
skip='^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libresolv|libutil|libcuda|libamdhip64|libhsa-runtime64|libamd_comgr|libdrm|libdrm_amdgpu|libnuma|libelf)\.so'
for bin in "$prefix"/bin/*; do
  ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }'
done | sort -u | while read -r name path; do
  if [[ "$name" =~ $skip ]] || [[ "$path" == /opt/rocm* ]]; then continue; fi
  cp -L "$path" "$prefix/lib/$name"
done

# The staged binaries must find every library in lib/ or the system.
unresolved=$(for bin in "$prefix"/bin/*; do LD_LIBRARY_PATH="$prefix/lib" ldd "$bin"; done | grep "not found" || true)
if [ -n "$unresolved" ]; then
  echo "deploy/build.sh: unresolved libraries:" >&2
  echo "$unresolved" >&2
  exit 1
fi
LD_LIBRARY_PATH="$prefix/lib" "$prefix/bin/moed" --help >/dev/null
echo "deploy/build.sh: $backend staged in $prefix ($(find "$prefix/lib" -type f | wc -l) bundled libraries, GPU backend: $gpu_built)"
