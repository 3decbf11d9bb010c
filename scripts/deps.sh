#!/usr/bin/env bash
# Installs everything the build and the tests need, idempotently:
# Debian packages (apt-get update once, then only what is missing) and the
# PyPI packages of the test oracles and of tools/convert_checkpoint.py into a
# project-local venv (.venv), and Triton's perf_analyzer into .venv/perf_analyzer.
# Usage: scripts/deps.sh [--no-python] [--no-hip]
# Debian's HIP toolchain is installed so that the AMD GPU path is compile-
# checked everywhere (CI has no GPU); --no-hip skips it.
set -euo pipefail
cd "$(dirname "$0")/.."

want_python=1
want_hip=1
for a in "$@"; do
  case "$a" in
    --no-python) want_python=0 ;;
    --no-hip) want_hip=0 ;;
    *) echo "deps.sh: unknown option $a" >&2; exit 2 ;;
  esac
done

pkgs=(
  build-essential cmake pkg-config
  check libsubunit-dev                      # unit tests
  libgrpc-dev protobuf-c-compiler libprotobuf-c-dev grpc-proto libprotobuf-dev protobuf-compiler
  libuv1-dev libhttp-parser-dev             # event loop, HTTP side port
  libcjson-dev libxxhash-dev libjemalloc-dev
  libssl-dev                                # TLS on the HTTP ports (server/http_conn.c, server/tls.c)
  python3 python3-venv python3-dev
  valgrind
  clang-format                              # .ci/run: the tree stays formatted (scripts/check-format.sh)
  cppcheck                                  # .ci/run: static analysis of the C sources (scripts/cppcheck.sh)
  shellcheck                                # .ci/run: deploy/check.sh lints deploy/*.sh
  libb64-0d                                 # perf_analyzer (scripts/requirements-perf.txt)
  clang libclang-rt-14-dev                  # .ci/run: libFuzzer targets (scripts/fuzz.sh)
  openssl                                   # test_security.py makes its certificates with the CLI
  libopenblas-dev                           # bench: the CPU's fp32 GEMM ceiling (moe-bench-cpu)
)
# AMD compile check: Debian's HIP toolchain.
[ "$want_hip" = 1 ] && pkgs+=(hipcc libamdhip64-dev rocm-device-libs)

bash scripts/apt-install.sh "${pkgs[@]}"

if [ "$want_python" = 1 ]; then
  # Debian's python (not a pyenv one): the venv must match the system ABI.
  py=/usr/bin/python3
  if [ ! -x .venv/bin/python ]; then
    "$py" -m venv .venv
  fi
  need=$(.venv/bin/python - <<'PY'
import importlib.util as u
mods = {"numpy": "numpy", "ml_dtypes": "ml_dtypes", "tritonclient": "tritonclient[grpc,http]", "geventhttpclient": "tritonclient[http]",
        "grpc": "grpcio", "safetensors": "safetensors"}
print(" ".join(p for m, p in mods.items() if u.find_spec(m) is None))
PY
)
  if [ -n "$need" ]; then
    # shellcheck disable=SC2086
    .venv/bin/pip install -q -r scripts/requirements-test.txt
  fi
  # Triton's perf_analyzer, apart from the venv's own packages (why this
  # release: scripts/requirements-perf.txt)
  if [ ! -x .venv/perf_analyzer/bin/perf_analyzer ]; then
    .venv/bin/pip install -q --no-deps --upgrade --target .venv/perf_analyzer -r scripts/requirements-perf.txt
  fi
fi
