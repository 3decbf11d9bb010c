#!/usr/bin/env bash
# Batch invariance end to end on a GPU machine, under load: requests sent
# alone to a moed on the GPU, then the same requests sent again while
# `moec bench` keeps 64 others in flight, so that they run merged into
# batches with other requests (and, on a GPU worker, held while the next
# batch is launched behind them: infer_run.c). Every output must come back
# bit-identical to the request alone, the load must have merged requests
# (fewer executions than requests) and every request must succeed.
#   tests/gpu/moed_merge.sh BINDIR LOGDIR     (BINDIR: moed, moec, moe-mkset)
# env: MOE_MERGE_DEVICE=cpu   a dry run on a machine without a GPU
set -euo pipefail
bin=$(cd "$1" && pwd); log=$2
mkdir -p "$log"
log=$(cd "$log" && pwd)
work=$(mktemp -d)
pid=""
trap 'kill $pid 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT
N=24 # checked requests, each model

"$bin/moe-mkset" --out "$work/models/qwen_int4" --scheme wna16 --bits 4 --group-size 128 --experts 128 \
  --hidden 2048 --intermediate 768 --top-k 8 --seed 3 >/dev/null
"$bin/moed" --device "${MOE_MERGE_DEVICE:-gpu}" --model-repository "$work/models" --grpc-port 0 --http-port 0 \
  --rest-port -1 --max-queue-delay-us 0 --port-file "$work/port" >"$log/moed-merge.log" 2>&1 &
pid=$!
for _ in $(seq 100); do [ -s "$work/port" ] && break; sleep 0.1; done
read -r gport hport _ <"$work/port"

python3 - "$work" "$N" <<'PY'
import sys, numpy as np
w, n = sys.argv[1], int(sys.argv[2]); rng = np.random.default_rng(11)
def bf16(a): return (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
for i in range(n):
    t = 1 + i % 3  # 1 to 3 tokens a request
    np.save(f"{w}/h{i}.npy", bf16(rng.standard_normal((t, 2048))))
    np.save(f"{w}/l{i}.npy", rng.standard_normal((t, 128)).astype(np.float32))
    np.save(f"{w}/x{i}.npy", bf16(rng.standard_normal((t, 7168)) * 3))
PY

send() { # $1 alone|merged, $2 i
  mkdir -p "$work/$1/q$2" "$work/$1/p$2"
  "$bin/moec" -a "127.0.0.1:$gport" infer -m qwen_int4 --input "hidden_states=$work/h$2.npy:BF16" \
    --input "router_logits=$work/l$2.npy" --output-dir "$work/$1/q$2" >>"$log/moec-merge.log" 2>&1
  "$bin/moec" -a "127.0.0.1:$gport" infer -m quant.per_token --input "x=$work/x$2.npy:BF16" \
    --param out_dtype=int8 --output-dir "$work/$1/p$2" >>"$log/moec-merge.log" 2>&1
}
for i in $(seq 0 $((N - 1))); do send alone "$i"; done
execs() { curl -s "http://127.0.0.1:$hport/metrics" 2>/dev/null ||
  python3 -c "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())" \
    "http://127.0.0.1:$hport/metrics"; }
counts() { execs | awk '/^moed_worker_executions_total/ {e += $NF} /^moed_requests_total/ {r += $NF}
  END {print e + 0, r + 0}'; }
read -r e0 r0 < <(counts)
"$bin/moec" -a "127.0.0.1:$gport" bench -m qwen_int4 --input hidden_states=random:64x2048:BF16 \
  --input router_logits=random:64x128:FP32 --tokens 1 --variants 64 --concurrency 64 --duration 4 \
  --warmup 0.5 --json "$log/merge-bench.json" >"$log/merge-bench.txt" 2>&1 &
load=$!
sleep 1
senders=()
for i in $(seq 0 $((N - 1))); do
  send merged "$i" &
  senders+=($!)
done
wait_rc=0
for j in "${senders[@]}"; do wait "$j" || wait_rc=1; done
wait "$load" || { echo "FAIL moec bench under the checked requests: exit $?"; wait_rc=1; }
read -r e1 r1 < <(counts)

python3 - "$work" "$N" "$((e1 - e0))" "$((r1 - r0))" "$wait_rc" <<'PY' | tee "$log/merge.txt"
import glob, os, sys
w, n, execs, reqs, rc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
bad = 0
def check(ok, what):
    global bad
    bad += not ok
    print(("ok   " if ok else "FAIL ") + what)
check(rc == 0, "every checked request and the load answered OK")
same = total = 0
for kind in ("q", "p"):
    for i in range(n):
        a = sorted(glob.glob(f"{w}/alone/{kind}{i}/*.npy"))
        m = sorted(glob.glob(f"{w}/merged/{kind}{i}/*.npy"))
        total += 1
        if a and [os.path.basename(f) for f in a] == [os.path.basename(f) for f in m] and all(
                open(x, "rb").read() == open(y, "rb").read() for x, y in zip(a, m)):
            same += 1
check(same == total, f"{same} of {total} requests bit-identical alone and merged under load")
check(0 < execs < reqs, f"requests merged under the load: {execs} executions for {reqs} requests")
print(f"{'all passed' if not bad else f'{bad} failed'}")
sys.exit(1 if bad else 0)
PY
