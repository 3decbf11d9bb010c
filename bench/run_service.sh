#!/bin/sh
# Service benchmark (BENCH.md "Service"; not a test): moed against a minimal
# gRPC C-core echo server, both on loopback, measured in the same run by the
# same load generator. Prints a markdown table.
#
#   bench/run_service.sh [BUILD_DIR]      (default: build)
# env: SECONDS_PER (measured seconds per point, default 2), WARMUP (0.5),
#      ROUNDS (default 3: each point measured ROUNDS times, echo and moed
#      alternating, and the median of each column reported: the machine is
#      shared, single runs are noisy), CALLS (64 MiB calls, default 5),
#      MOED_ARGS (moed flags).
#
# Rows: a 4 KiB quant.per_tensor call (FP32 [1, 1024] -> fp8) at concurrency
# 1, 8, 64: p50/p99 latency and calls/s, moed vs echo (which sends the 4 KiB
# request back). Then a 64 MiB activation (BF16 [4096, 8192]) through
# quant.per_token: request bytes / median end-to-end time; the echo row is
# the same 64 MiB sent there and back, the transport's own ceiling here.
set -eu
BUILD=${1:-build}
SECONDS_PER=${SECONDS_PER:-2}
WARMUP=${WARMUP:-0.5}
CALLS=${CALLS:-5}
ROUNDS=${ROUNDS:-3}
THREADS=$(nproc)
MOED_ARGS=${MOED_ARGS:-"--workers 1 --threads-per-worker $THREADS"}
TMP=$(mktemp -d)
ECHO_PID=
MOED_PID=
cleanup() {
  [ -n "$ECHO_PID" ] && kill "$ECHO_PID" 2>/dev/null || true
  [ -n "$MOED_PID" ] && kill "$MOED_PID" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$TMP"
}
trap cleanup EXIT
trap "exit 1" INT TERM PIPE  # so that EXIT runs (and stops the servers) on a signal too

wait_file() {
  i=0
  while [ ! -s "$1" ]; do
    i=$((i + 1))
    [ $i -gt 200 ] && { echo "run_service.sh: $2 did not start" >&2; exit 1; }
    sleep 0.05
  done
}

"$BUILD/bench/moe-echo-server" --port 0 --port-file "$TMP/echo.port" &
ECHO_PID=$!
# shellcheck disable=SC2086  # MOED_ARGS is a list of flags
"$BUILD/server/moed" --address 127.0.0.1 --grpc-port 0 --http-port -1 --rest-port -1 --log-level warn \
  --port-file "$TMP/moed.port" $MOED_ARGS &
MOED_PID=$!
wait_file "$TMP/echo.port" echo_server
wait_file "$TMP/moed.port" moed
ECHO=127.0.0.1:$(cat "$TMP/echo.port")
MOED=127.0.0.1:$(cut -d' ' -f1 "$TMP/moed.port")

field() { echo "$1" | tr ' ' '\n' | sed -n "s/^$2=//p"; }
# median of column $2 over the lines of $1
median() { echo "$1" | while read -r l; do field "$l" "$2"; done | sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "-" }'; }
small() {
  "$BUILD/bench/moe-bench-service" --target "$1" --mode small --concurrency "$2" --seconds "$SECONDS_PER" \
    --warmup "$WARMUP"
}

echo "| load | server | p50 µs | p99 µs | calls/s | p50 vs echo (<= 1.3) | calls/s vs echo (>= 0.7) |"
echo "|---|---|---|---|---|---|---|"
for c in 1 8 64; do
  e=
  m=
  r=0
  while [ $r -lt "$ROUNDS" ]; do
    e="$e$(small "$ECHO" "$c")
"
    m="$m$(small "$MOED" "$c")
"
    r=$((r + 1))
  done
  e=$(printf '%s' "$e" | sed '/^$/d')
  m=$(printf '%s' "$m" | sed '/^$/d')
  ep50=$(median "$e" p50_us) ecps=$(median "$e" calls_per_s)
  mp50=$(median "$m" p50_us) mcps=$(median "$m" calls_per_s)
  echo "| 4 KiB quant.per_tensor, c=$c | echo | $ep50 | $(median "$e" p99_us) | $ecps | | |"
  echo "| 4 KiB quant.per_tensor, c=$c | moed | $mp50 | $(median "$m" p99_us) | $mcps |" \
    "$(ratio "$mp50" "$ep50") | $(ratio "$mcps" "$ecps") |"
done
echo
echo "| 64 MiB activation, 1 at a time | median ms | GB/s (request bytes / time; target >= 1) |"
echo "|---|---|---|"
e=$("$BUILD/bench/moe-bench-service" --target "$ECHO" --mode large --calls "$CALLS")
echo "| echo (64 MiB there and back) | $(field "$e" median_ms) | $(field "$e" gbps) |"
for d in int8 fp8_e4m3fn; do
  m=$("$BUILD/bench/moe-bench-service" --target "$MOED" --mode large --calls "$CALLS" --out-dtype "$d")
  echo "| moed quant.per_token -> $d | $(field "$m" median_ms) | $(field "$m" gbps) |"
done
