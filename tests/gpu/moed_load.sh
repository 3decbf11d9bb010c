#!/usr/bin/env bash
# Load on a GPU machine (issue 11's benchmark; docs/load-bench.md): moed on
# the GPU driven by `moec bench`, in three tables written to LOGDIR/load.md
# with every raw report beside it (LOGDIR/raw/):
#  1. decode: expert sets of Qwen3-30B-A3B (E 128, k 8, H 2048, I 768) and
#     Mixtral (E 8, k 2, H 4096, I 14336) layers, wna16 int4 g128 and bf16,
#     T = 1 per request (router_logits; --variants: each request routes
#     differently), closed loop at concurrency 1, 8, 64, 256, one moed per
#     --max-queue-delay-us in MOE_LOAD_DELAYS; requests/s, tokens/s,
#     p50/p99, the batches moed formed (ModelStatistics batch_stats and the
#     /metrics moed_batch_size histogram, before and after each level), and
#     issue 11's targets (concurrency 64 >= 10x the requests/s of 1; p99 <=
#     3 x (max_queue_delay + the level's mean compute per batch));
#  2. service overhead: time per token at concurrency 64 through moed
#     against the op in-process (moe-bench-gpu --fused) at the batch sizes
#     moed formed (times between its token counts 1, 4, 16, 64, 256
#     interpolated linearly), and against moed's own compute time;
#  3. large activations: a [4096, 7168] bf16 request (quant.per_token ->
#     int8, and an expert set with H 7168) end to end, one at a time, in
#     GB/s against moe-echo-server sending the same request back.
# Per level also where the device worker's time went per batch (the
# moed_worker_phase_seconds_total deltas: gather, prepare, copy_in, launch,
# copy_out, wait, answer, answer_async; us per execution).
# The script checks its numbers (each level's counts are the sums over its
# windows, percentiles ordered, the batches' rows are the requests' tokens,
# /metrics agrees with ModelStatistics) and exits 1 when a check or a
# request failed.
#   tests/gpu/moed_load.sh BINDIR LOGDIR
# BINDIR: moed, moec, moe-mkset, moe-echo-server and moe-bench-gpu, or
# tests/gpu/pack.sh's output (bin.tar.xz, unpacked here, and lib/).
# env: MOE_LOAD_DEVICE=cpu   a dry run on a machine without a GPU: moed --device cpu,
#                            small layers, [64, 7168] requests, short windows, no in-process bench
#      MOE_LOAD_DELAYS       --max-queue-delay-us of each moed (default "0 1000")
#      MOE_LOAD_SETS         the decode sets measured (default all: qwen3_int4 qwen3_bf16 mixtral_int4 mixtral_bf16)
#      MOE_LOAD_LEVELS       the concurrency levels (default "1 8 64 256"; the targets need 1 and 64)
#      MOE_LOAD_QUICK=1      decode only: no in-process bench, no large activations (tests/gpu/worker_phases.sh)
#      MOE_LOAD_WINDOW_MS, MOE_LOAD_MAX_WINDOWS, MOE_LOAD_WARMUP   each level's measurement
#                            (default: 0.5 s of warm-up, then 3 windows of 1000 ms; "stable" when
#                            they agree within 10 %)
set -euo pipefail
bin=$(cd "$1" && pwd)
mkdir -p "$2/raw"
log=$(cd "$2" && pwd)
device=${MOE_LOAD_DEVICE:-gpu}
delays=${MOE_LOAD_DELAYS:-0 1000}
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
start_s=$(date +%s)
stamp() { echo "[$(($(date +%s) - start_s)) s] $*"; }

[ -d "$bin/lib" ] && export LD_LIBRARY_PATH=$bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if [ -f "$bin/bin.tar.xz" ]; then
  mkdir "$work/bin"
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$bin/bin.tar.xz" "$work/bin"
  chmod +x "$work/bin"/*
  bin=$work/bin
fi
for b in moed moec moe-mkset moe-echo-server; do
  [ -x "$bin/$b" ] || { echo "moed_load.sh: $bin/$b missing (tests/gpu/pack.sh packs it)" >&2; exit 2; }
done

# layers: name scheme E k H I (the dry run's are small; "big" is the large-activation set, H 7168)
if [ "$device" = cpu ]; then
  layers=("qwen3_int4 wna16 16 4 256 128" "qwen3_bf16 bf16 16 4 256 128" "mixtral_int4 wna16 8 2 512 512"
    "mixtral_bf16 bf16 8 2 512 512")
  big="big wna16 4 2 7168 128"
  rows=64 window=${MOE_LOAD_WINDOW_MS:-300} windows=${MOE_LOAD_MAX_WINDOWS:-3} warmup=${MOE_LOAD_WARMUP:-0.2}
  large_calls=5
else
  layers=("qwen3_int4 wna16 128 8 2048 768" "qwen3_bf16 bf16 128 8 2048 768"
    "mixtral_int4 wna16 8 2 4096 14336" "mixtral_bf16 bf16 8 2 4096 14336")
  big="big wna16 8 2 7168 2048"
  rows=4096 window=${MOE_LOAD_WINDOW_MS:-1000} windows=${MOE_LOAD_MAX_WINDOWS:-3} warmup=${MOE_LOAD_WARMUP:-0.5}
  large_calls=20
fi
levels=${MOE_LOAD_LEVELS:-1 8 64 256}
quick=${MOE_LOAD_QUICK:-0}
if [ -n "${MOE_LOAD_SETS:-}" ]; then
  picked=()
  for l in "${layers[@]}"; do
    for want in $MOE_LOAD_SETS; do [ "${l%% *}" = "$want" ] && picked+=("$l"); done
  done
  [ ${#picked[@]} -gt 0 ] || { echo "moed_load.sh: MOE_LOAD_SETS '$MOE_LOAD_SETS' names no set" >&2; exit 2; }
  layers=("${picked[@]}")
fi

stamp "expert sets (moe-mkset, in parallel)"
mk=()
sets=("${layers[@]}")
[ "$quick" = 1 ] || sets+=("$big")
for l in "${sets[@]}"; do
  read -r name scheme e k h i <<<"$l"
  q=()
  [ "$scheme" = wna16 ] && q=(--bits 4 --group-size 128)
  "$bin/moe-mkset" --out "$work/models/$name" --scheme "$scheme" "${q[@]}" --experts "$e" --hidden "$h" \
    --intermediate "$i" --top-k "$k" --seed 7 >"$log/raw/mkset-$name.log" 2>&1 &
  mk+=($!)
done
for p in "${mk[@]}"; do wait "$p"; done

# one moed per delay, all started at once (each loads the sets)
for d in $delays; do
  "$bin/moed" --device "$device" --model-repository "$work/models" --address 127.0.0.1 --grpc-port 0 \
    --http-port 0 --rest-port 0 --port-file "$work/port-$d" --max-batch-tokens 4096 --max-queue-delay-us "$d" \
    --log-level warn >"$log/moed-delay$d.log" 2>&1 &
  pids+=($!)
done
"$bin/moe-echo-server" --port 0 --port-file "$work/port-echo" >"$log/echo.log" 2>&1 &
pids+=($!)

cat >"$work/load.py" <<'PY'
"""The script's Python side (standard library only): waiting for moed,
snapshots of ModelStatistics (REST) and /metrics, the in-process bench's
table, and the report."""
import json, math, os, re, sys, time, urllib.error, urllib.request


def get(url):
    return urllib.request.urlopen(url, timeout=30).read().decode()


def wait_ready(rest, models):
    for _ in range(1800):  # the sets load (host memory) before they are ready: up to 3 min
        try:
            if all(urllib.request.urlopen(f"http://127.0.0.1:{rest}/v2/models/{m}/ready", timeout=5).status == 200
                   for m in models):
                return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    sys.exit(f"moed on REST port {rest}: {models} not ready after 3 min")


def snap(rest, http, model, out):
    stats = json.loads(get(f"http://127.0.0.1:{rest}/v2/models/{model}/stats"))["model_stats"][0]
    json.dump({"stats": stats, "metrics": get(f"http://127.0.0.1:{http}/metrics")}, open(out, "w"))


def metric(text, name, **labels):
    """{le or '': value} of the samples of `name` whose labels include `labels`."""
    out = {}
    for line in text.splitlines():
        m = re.match(r'([a-z_]+)(?:\{(.*)\})? (\S+)$', line)
        if not m or m.group(1) != name:
            continue
        ls = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(ls.get(k) == v for k, v in labels.items()):
            out[ls.get("le", "")] = float(m.group(3))
    return out


def total(text, name, **labels):
    """The sum of the samples of `name` whose labels include `labels` (every worker's)."""
    return sum(metric_samples(text, name, labels))


def metric_samples(text, name, labels):
    for line in text.splitlines():
        m = re.match(r'([a-z_]+)(?:\{(.*)\})? (\S+)$', line)
        if m and m.group(1) == name:
            ls = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if all(ls.get(k) == v for k, v in labels.items()):
                yield float(m.group(3))


PHASES = ("gather", "prepare", "copy_in", "launch", "copy_out", "wait", "answer", "answer_async")


def phases(before, after):
    """(executions, {phase: us per execution}) of the device workers between two scrapes."""
    n = total(after, "moed_worker_executions_total") - total(before, "moed_worker_executions_total")
    per = {p: (total(after, "moed_worker_phase_seconds_total", phase=p) -
               total(before, "moed_worker_phase_seconds_total", phase=p)) * 1e6 / n if n else float("nan")
           for p in PHASES}
    return int(n), per


def bench_gpu_table(path):
    """{(layer, scheme): {T: us}} from moe-bench-gpu --fused's table."""
    t = {}
    if not os.path.exists(path):
        return t
    for line in open(path):
        c = [x.strip() for x in line.strip().strip("|").split("|")]
        if len(c) >= 4 and c[2].isdigit():
            t.setdefault((c[0], "int4" if "int4" in c[1] else c[1]), {})[int(c[2])] = float(c[3])
    return t


def interp(pts, x):
    """Linear interpolation of {T: us} at x (T outside: the nearest two)."""
    xs = sorted(pts)
    if x in pts:
        return pts[x]
    if len(xs) < 2:
        return None
    lo = max([v for v in xs if v < x] or [xs[0]])
    hi = min([v for v in xs if v > x] or [xs[-1]])
    if lo == hi:
        lo, hi = (xs[-2], xs[-1]) if x > xs[-1] else (xs[0], xs[1])
    return pts[lo] + (pts[hi] - pts[lo]) * (x - lo) / (hi - lo)


class Report:
    def __init__(self):
        self.fails = []

    def check(self, ok, what):
        if not ok:
            self.fails.append(what)
        return ok


def level(rep, raw, delay, model, c):
    """One level: moec's JSON and the server's deltas, checked."""
    base = f"{raw}/d{delay}/{model}/c{c}"
    j = json.load(open(f"{base}.json"))
    lv = j["levels"][0]
    b, a = json.load(open(f"{base}.before.json")), json.load(open(f"{base}.after.json"))
    what = f"delay {delay} {model} c={c}"
    w = lv["windows"]
    for k in ("requests", "ok", "tokens"):
        rep.check(lv[k] == sum(x[k] for x in w), f"{what}: {k} {lv[k]} = the sum over {len(w)} windows")
    lat = lv["latency_ms"]
    rep.check(lv["ok"] > 0 and lv["errors"] == 0, f"{what}: {lv['ok']} ok, {lv['errors']} errors "
              f"{lv['errors_by_status']} {lv.get('first_error', '')}")
    rep.check(0 < lat["p50"] <= lat["p90"] <= lat["p95"] <= lat["p99"] <= lat["max"], f"{what}: percentiles ordered")
    rep.check(lv["tokens"] == lv["ok"], f"{what}: one token per request")
    # batches formed in the level (warm-up and the calls after its last window included)
    bs = {x["batch_size"]: x["compute_infer"] for x in a["stats"].get("batch_stats", [])}
    b0 = {x["batch_size"]: x["compute_infer"] for x in b["stats"].get("batch_stats", [])}
    batches = {s: (v["count"] - b0.get(s, {}).get("count", 0), v["ns"] - b0.get(s, {}).get("ns", 0))
               for s, v in bs.items()}
    batches = {s: v for s, v in batches.items() if v[0] > 0}
    rows = sum(s * n for s, (n, _) in batches.items())
    execs = sum(n for n, _ in batches.values())
    infer_d = a["stats"]["inference_count"] - b["stats"]["inference_count"]
    ok_d = a["stats"]["inference_stats"]["success"]["count"] - b["stats"]["inference_stats"]["success"]["count"]
    rep.check(rows == infer_d == ok_d == lv["sent_ok"],
              f"{what}: rows in batches {rows} = inference_count delta {infer_d} = successes {ok_d} = "
              f"moec's ok calls {lv['sent_ok']}")
    rep.check(lv["server"] is not None and lv["server"]["requests"] == ok_d,
              f"{what}: moec's ModelStatistics delta {lv['server'] and lv['server']['requests']} = {ok_d}")
    hb = metric(b["metrics"], "moed_batch_size_bucket", model=model)
    ha = metric(a["metrics"], "moed_batch_size_bucket", model=model)
    hist = {le: ha[le] - hb.get(le, 0) for le in ha}
    cnt = metric(a["metrics"], "moed_batch_size_count", model=model)[""] - \
        metric(b["metrics"], "moed_batch_size_count", model=model)[""]
    tot = metric(a["metrics"], "moed_batch_size_sum", model=model)[""] - \
        metric(b["metrics"], "moed_batch_size_sum", model=model)[""]
    rep.check(cnt == execs and tot == rows and hist.get("+Inf") == cnt,
              f"{what}: /metrics moed_batch_size count {cnt} / sum {tot} = batch_stats' {execs} / {rows}")
    for le, v in hist.items():
        if le != "+Inf":
            n = sum(m for s, (m, _) in batches.items() if s <= float(le))
            rep.check(v == n, f"{what}: moed_batch_size le={le}: {v} = batch_stats' {n}")
    compute_ns = sum(ns for _, ns in batches.values())
    return {"lv": lv, "batches": batches, "execs": execs, "rows": rows, "hist": hist,
            "phases": phases(b["metrics"], a["metrics"]),
            "compute_per_batch_us": compute_ns / execs / 1e3 if execs else 0.0,
            "queue_us": lv["server"]["queue_us"] if lv["server"] else float("nan")}


def fmt_hist(hist):
    """Non-cumulative counts per power-of-two bucket, the non-empty ones."""
    les = sorted((float(k), v) for k, v in hist.items() if k != "+Inf")
    out, prev_le, prev = [], 0, 0
    for le, v in les:
        if v - prev:
            lo = int(prev_le) + 1
            out.append(f"{lo}" + (f"-{int(le)}" if int(le) > lo else "") + f": {int(v - prev)}")
        prev_le, prev = le, v
    return ", ".join(out) or "-"


def report(argv):
    raw, out, device = argv[0], argv[1], argv[2]
    delays, models, levels = argv[3].split(), argv[4].split(), [int(c) for c in argv[5].split()]
    quick = argv[6] == "1"
    layer_of = {"qwen3": "qwen3-30b-a3b", "mixtral": "mixtral-8x7b"}
    rep = Report()
    L = {(d, m, c): level(rep, raw, d, m, c) for d in delays for m in models for c in levels}
    md = [f"# moed under load ({'dry run on the CPU: small layers' if device == 'cpu' else 'GPU'})", ""]
    md += ["## Decode: expert sets, T = 1 per request, closed loop", "",
           "One moed per max_queue_delay_us (--max-batch-tokens 4096); requests/s and tokens/s over the measured "
           "windows; latency from moec (client side); queue = ModelStatistics' queue time per request; batches: "
           "executions in the level (warm-up included), mean rows per batch and moed's compute time per batch "
           "(batch_stats' compute_infer); the histogram is /metrics moed_batch_size's delta (rows: batches).", "",
           "| set | delay us | concurrency | requests | requests/s | tokens/s | p50 ms | p99 ms | queue us | batches | "
           "rows/batch | compute us/batch | batch sizes | windows (stable) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in models:
        for d in delays:
            for c in levels:
                x = L[(d, m, c)]
                lv = x["lv"]
                md.append(f"| {m} | {d} | {c} | {lv['requests']} | {lv['requests_per_s']:.0f} | "
                          f"{lv['tokens_per_s']:.0f} | {lv['latency_ms']['p50']:.3f} | {lv['latency_ms']['p99']:.3f} | "
                          f"{x['queue_us']:.0f} | {x['execs']} | {x['rows'] / max(x['execs'], 1):.1f} | "
                          f"{x['compute_per_batch_us']:.0f} | {fmt_hist(x['hist'])} | {len(lv['windows'])} "
                          f"({'yes' if lv['stable'] else 'no' if lv['stable'] is False else '-'}) |")
    md += ["", "## Device worker phases per batch", "",
           "moed_worker_phase_seconds_total and moed_worker_executions_total deltas over the level (every worker; "
           "warm-up included): us per execution in each phase, in the order a batch passes through them "
           "(docs/server.md \"Metrics\"); worker = the worker thread's own (every phase but answer_async, which the "
           "answer thread spends beside the next batch); host = the worker's but wait.", "",
           "| set | delay us | concurrency | requests/s | executions | " + " | ".join(PHASES) +
           " | worker us | host us |", "|---|---|---|---|---|" + "---|" * (len(PHASES) + 2)]
    for m in models:
        for d in delays:
            for c in levels:
                x = L[(d, m, c)]
                n, per = x["phases"]
                own = sum(v for p, v in per.items() if p != "answer_async")
                md.append(f"| {m} | {d} | {c} | {x['lv']['requests_per_s']:.0f} | {n} | " +
                          " | ".join(f"{per[p]:.1f}" for p in PHASES) + f" | {own:.1f} | {own - per['wait']:.1f} |")
    have = 1 in levels and 64 in levels
    md += ["", "Targets (issue 11): requests/s at concurrency 64 >= 10 x at 1; p99 at 64 <= 3 x (delay + compute "
           "per batch at 64).", "",
           "| set | delay us | requests/s 64 / 1 | >= 10 | p99 at 64 ms | 3 x (delay + compute/batch) ms | met |",
           "|---|---|---|---|---|---|---|"]
    for m in models if have else []:
        for d in delays:
            one, sf = L[(d, m, 1)], L[(d, m, 64)]
            ratio = sf["lv"]["requests_per_s"] / max(one["lv"]["requests_per_s"], 1e-9)
            bound = 3 * (int(d) + sf["compute_per_batch_us"]) / 1e3
            p99 = sf["lv"]["latency_ms"]["p99"]
            md.append(f"| {m} | {d} | {ratio:.1f} | {'yes' if ratio >= 10 else 'no'} | {p99:.3f} | {bound:.3f} | "
                      f"{'yes' if p99 <= bound else 'no'} |")

    ip = bench_gpu_table(f"{raw}/bench-gpu.txt")
    d0 = delays[0]
    md += ["", f"## Service overhead: time per token at concurrency 64 (delay {d0} us)", "",
           "moed: 1 / tokens/s of the level. moed compute: batch_stats' compute_infer over the batches formed, per "
           "row (moed's own op time, copies in and out included; summed over the workers, so with several it can "
           "exceed the wall time). In-process: moe-bench-gpu --fused on the same "
           "GPU at the sizes formed (each size's time interpolated linearly between the bench's T = 1, 4, 16, "
           "64, 256; pre-routed topk_ids, 8 rotated routings), weighted by how many batches of each size ran.", "",
           "| set | batches (rows/batch) | moed us/token | moed compute us/token | in-process us/token | "
           "moed / in-process (<= 1.15) | moed / moed compute |",
           "|---|---|---|---|---|---|---|"]
    for m in models if have else []:
        x = L[(d0, m, 64)]
        per_tok = 1e6 / x["lv"]["tokens_per_s"] if x["lv"]["tokens_per_s"] else float("nan")
        comp = sum(ns for _, ns in x["batches"].values()) / 1e3 / max(x["rows"], 1)
        layer, scheme = m.split("_")
        pts = ip.get((layer_of[layer], scheme), {})
        if pts and x["rows"]:
            t_in = sum(n * interp(pts, s) for s, (n, _) in x["batches"].items()) / x["rows"]
            inproc, ratio = f"{t_in:.2f}", f"{per_tok / t_in:.2f} {'yes' if per_tok / t_in <= 1.15 else 'no'}"
        else:
            inproc, ratio = "- (no GPU bench)", "-"
        md.append(f"| {m} | {x['execs']} ({x['rows'] / max(x['execs'], 1):.1f}) | {per_tok:.2f} | {comp:.2f} | "
                  f"{inproc} | {ratio} | {per_tok / comp if comp else float('nan'):.2f} |")
    if ip:
        md += ["", "moe-bench-gpu's times (us) at its token counts: " + "; ".join(
            f"{k[0]} {k[1]}: " + ", ".join(f"T={t} {v:.1f}" for t, v in sorted(p.items())) for k, p in sorted(ip.items()))]

    if not quick:
        md += ["", "## Large activations: one request at a time, end to end (gRPC in, op, gRPC out)", "",
               "GB/s = (request + response bytes) / median latency; the echo rows are moe-echo-server answering "
               "the same request message with itself, in the same run; server split: moed's ModelStatistics per "
               "request.", "", "| request | target | calls | request MB | response MB | p50 ms | p99 ms | GB/s | "
               "vs echo | queue / input / infer / output us |", "|---|---|---|---|---|---|---|---|---|---|"]
    for case in () if quick else ("per_token", "fused"):
        row = {}
        for tgt in ("moed", "echo"):
            j = json.load(open(f"{raw}/large-{case}-{tgt}.json"))["levels"][0]
            what = f"large {case} {tgt}"
            rep.check(j["ok"] == j["requests"] > 0, f"{what}: {j['ok']} of {j['requests']} ok {j.get('first_error', '')}")
            resp = j["received_bytes_per_s"] * j["elapsed_s"] / max(j["ok"], 1)
            p50 = j["latency_ms"]["p50"]
            gbs = (j["request_bytes"] + resp) / (p50 * 1e-3) / 1e9 if p50 else 0
            row[tgt] = (j, resp, p50, gbs)
        if row["echo"][3]:
            rep.check(abs(row["echo"][1] - row["echo"][0]["request_bytes"]) <= 16,
                      f"large {case}: echo answers the request's bytes ({row['echo'][1]:.0f} vs "
                      f"{row['echo'][0]['request_bytes']})")
        for tgt in ("moed", "echo"):
            j, resp, p50, gbs = row[tgt]
            s = j["server"]
            split = (f"{s['queue_us']:.0f} / {s['compute_input_us']:.0f} / {s['compute_infer_us']:.0f} / "
                     f"{s['compute_output_us']:.0f}") if s else "-"
            vs = f"{gbs / row['echo'][3]:.2f}" if tgt == "moed" and row["echo"][3] else ""
            name = {"per_token": "quant.per_token -> int8", "fused": "expert set big (H 7168)"}[case]
            md.append(f"| {name} | {tgt} | {j['requests']} | {j['request_bytes'] / 1e6:.1f} | {resp / 1e6:.1f} | "
                      f"{p50:.2f} | {j['latency_ms']['p99']:.2f} | {gbs:.2f} | {vs} | {split} |")

    md += ["", "## Checks", ""]
    md += [f"- FAIL {f}" for f in rep.fails] or ["- every check passed (counts = sums over windows, percentiles "
                                                 "ordered, batch rows = requests, /metrics = batch_stats)"]
    open(out, "w").write("\n".join(md) + "\n")
    print("\n".join(md))
    return 1 if rep.fails else 0


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "wait":
        wait_ready(args[0], args[1:])
    elif cmd == "snap":
        snap(*args)
    elif cmd == "report":
        sys.exit(report(args))
PY

for _ in $(seq 600); do
  ok=1
  for d in $delays echo; do [ -s "$work/port-$d" ] || ok=0; done
  [ $ok = 1 ] && break
  sleep 0.1
done
declare -A grpc http rest
for d in $delays; do
  [ -s "$work/port-$d" ] || { echo "moed (delay $d) did not start:" >&2; tail "$log/moed-delay$d.log" >&2; exit 1; }
  read -r "grpc[$d]" "http[$d]" "rest[$d]" <"$work/port-$d"
done
echo_port=$(cat "$work/port-echo")
models=()
for l in "${layers[@]}"; do models+=("${l%% *}"); done
waited=("${models[@]}")
[ "$quick" = 1 ] || waited+=(big)
for d in $delays; do python3 "$work/load.py" wait "${rest[$d]}" "${waited[@]}"; done
stamp "moed ready (delays: $delays)"

moec() { timeout 120 "$bin/moec" "$@"; }
measure=(--warmup "$warmup" --window-ms "$window" --max-windows "$windows" --stability-pct 10)
for d in $delays; do
  for l in "${layers[@]}"; do
    read -r name scheme e k h i <<<"$l"
    mkdir -p "$log/raw/d$d/$name"
    inputs=(-m "$name" --input "hidden_states=random:1x$h:BF16" --input "router_logits=random:1x$e:FP32")
    # the first requests copy the set to the device (and pack it): before any level
    moec -a "127.0.0.1:${grpc[$d]}" bench "${inputs[@]}" --tokens 1 --variants 64 --concurrency 8 \
      --requests 64 --warmup 0 --json "$log/raw/d$d/$name/first.json" >/dev/null 2>"$log/raw/d$d/$name/first.err" ||
      echo "moed_load.sh: the first requests to $name (delay $d) failed: $(head -c 300 "$log/raw/d$d/$name/first.err")" >&2
    for c in $levels; do
      base=$log/raw/d$d/$name/c$c
      python3 "$work/load.py" snap "${rest[$d]}" "${http[$d]}" "$name" "$base.before.json"
      moec -a "127.0.0.1:${grpc[$d]}" bench "${inputs[@]}" --tokens 1 --variants 256 --concurrency "$c" \
        --channels 4 "${measure[@]}" --json "$base.json" >/dev/null 2>"$base.err" || true
      python3 "$work/load.py" snap "${rest[$d]}" "${http[$d]}" "$name" "$base.after.json"
    done
    stamp "decode $name, delay $d us"
  done
done

if [ "$device" != cpu ] && [ "$quick" != 1 ]; then
  [ -x "$bin/moe-bench-gpu" ] || { echo "moed_load.sh: $bin/moe-bench-gpu missing" >&2; exit 2; }
  : >"$log/raw/bench-gpu.txt"
  for only in qwen3,int4 qwen3,bf16 mixtral,int4 mixtral,bf16; do
    "$bin/moe-bench-gpu" --fused --only "$only" --tokens 1,4,16,64,256 >>"$log/raw/bench-gpu.txt" 2>&1 ||
      echo "moe-bench-gpu --only $only: exit $?" | tee -a "$log/raw/bench-gpu.txt"
  done
  stamp "in-process bench (moe-bench-gpu --fused)"
fi

d0=${delays%% *}
read -r _ _ be _ hb _ <<<"$big"
large=(--concurrency 1 --requests "$large_calls" --warmup 0.5)
run_large() { # case, target port, inputs...
  local case=$1 port=$2 tgt
  shift 2
  tgt=$([ "$port" = "$echo_port" ] && echo echo || echo moed)
  moec -a "127.0.0.1:$port" bench "$@" "${large[@]}" --json "$log/raw/large-$case-$tgt.json" >/dev/null \
    2>"$log/raw/large-$case-$tgt.err" || true
}
for port in "${grpc[$d0]}" "$echo_port"; do
  [ "$quick" = 1 ] && break
  run_large per_token "$port" -m quant.per_token --input "x=random:${rows}x7168:BF16" --param out_dtype=int8
  run_large fused "$port" -m big --input "hidden_states=random:${rows}x$hb:BF16" --input "router_logits=random:${rows}x$be:FP32"
done
[ "$quick" = 1 ] || stamp "large activations"
for d in $delays; do
  python3 - "${http[$d]}" "$log/metrics-delay$d.txt" <<'PY'
import sys, urllib.request
open(sys.argv[2], "w").write(urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=30).read().decode())
PY
done

rc=0
python3 "$work/load.py" report "$log/raw" "$log/load.md" "$device" "$delays" "${models[*]}" "$levels" "$quick" || rc=1
stamp "done (rc $rc)"
exit $rc
