"""Integration test: `moec bench` against a real moed on a free loopback port.

Short runs (about a second each) on a quant op and on fused_moe over a small
moe-mkset expert set; the JSON report must be self-consistent (requests > 0,
no errors, ok == requests, p50 <= p90 <= p95 <= p99 <= max, each level's
counts the sums over its windows); a sweep writes JSON, CSV and SVG that
agree (one row and one plotted point per level) and whose server-side
breakdown (ModelStatistics deltas) counts exactly the level's successful
calls; --tokens sends the token counts asked for, --variants different row
blocks; a server that never answers ModelStatistics costs 2 s, not a hang;
a wrong model is counted
by status with exit 1; --stream (ModelStreamInfer) likewise; bad flags
exit 2 naming the flag. Nothing here depends on the machine's speed beyond
"some requests complete".

env: MOED, MOEC, MOE_LIB, MOE_MKSET."""
import csv
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from moed_process import check, exit_with_summary, moed, print_log_tail  # noqa: E402

MOEC, MKSET = os.environ["MOEC"], os.environ["MOE_MKSET"]


def bench(port, *args, json_out=True):
    """Runs moec bench; with json_out, its JSON report (stdout) and the
    report's one level flattened into it (rep["levels"][0]'s keys at the top)."""
    cmd = [MOEC, "-a", f"127.0.0.1:{port}", "bench", *args] + (["--json", "-"] if json_out else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    rep = None
    if json_out and r.stdout.strip():
        try:
            rep = json.loads(r.stdout)
            if len(rep["levels"]) == 1:
                rep.update(rep["levels"][0])
        except (ValueError, KeyError):
            rep = None
    return r, rep


def level_consistent(lv, what, windows=True):
    """One level's numbers agree with each other: the counts are the sums
    over the windows, the percentiles are ordered, the server-side
    breakdown counts the level's successful calls."""
    lat = lv["latency_ms"]
    check(0 < lat["p50"] <= lat["p90"] <= lat["p95"] <= lat["p99"] <= lat["max"],
          f"{what}: p50 <= p90 <= p95 <= p99 <= max ({lat})")
    w = lv["windows"]
    sums = {k: sum(x[k] for x in w) for k in ("requests", "ok", "tokens")}
    check(len(w) >= 1 and sums == {k: lv[k] for k in sums},
          f"{what}: requests, ok and tokens are the sums over the {len(w)} windows ({sums})")
    if windows:
        el = sum(x["elapsed_s"] for x in w)
        check(abs(el - lv["elapsed_s"]) < 1e-6 and abs(lv["requests_per_s"] - lv["ok"] / el) < 1e-6 * lv["requests_per_s"] + 1e-9,
              f"{what}: requests/s = ok / the windows' time ({lv['requests_per_s']})")
    srv = lv["server"]
    check(srv is not None and all(srv[k] >= 0 for k in srv) and srv["requests"] == lv["sent_ok"] >= lv["ok"],
          f"{what}: ModelStatistics delta counts the level's successful calls, times >= 0 ({srv}, {lv['sent_ok']})")


def consistent(rep, what, windows=True):
    """The report of a run of one level where every request succeeded."""
    if rep is None:
        check(False, f"{what}: a JSON report")
        return
    check(rep["requests"] > 0 and rep["ok"] == rep["requests"] and rep["errors"] == 0 and
          rep["errors_by_status"] == {}, f"{what}: requests > 0, all ok ({rep['requests']}, {rep['errors']})")
    level_consistent(rep, what, windows)
    check(rep["requests_per_s"] > 0 and rep["sent_bytes_per_s"] > 0 and rep["received_bytes_per_s"] > 0,
          f"{what}: rates > 0")


def test_quant(port, tmp):
    r, rep = bench(port, "-m", "quant.per_tensor", "--input", "x=random:4x1024:FP32", "--param",
                   "out_dtype=fp8_e4m3fn", "--concurrency", "4", "--channels", "2", "--duration", "1",
                   "--warmup", "0.2")
    check(r.returncode == 0, f"quant closed loop exits 0 ({r.returncode}: {r.stderr.strip()})")
    consistent(rep, "quant closed loop")
    if rep:
        check(rep["request_bytes"] > 4 * 1024 * 4 and rep["concurrency"] == 4 and rep["channels"] == 2,
              f"quant: request bytes and the load echoed ({rep['request_bytes']})")
    # a fixed count, from a .npy file the client reads as for infer
    x = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32)
    np.save(os.path.join(tmp, "x.npy"), x)
    r, rep = bench(port, "-m", "quant.per_token", "--input", f"x={tmp}/x.npy", "--requests", "40",
                   "--concurrency", "2", "--warmup", "0")
    check(r.returncode == 0 and rep is not None and rep["requests"] == 40,
          f"--requests 40 from a .npy input: exactly 40 ({r.stderr.strip()})")
    consistent(rep, "quant --requests", windows=False)
    # open loop: the schedule decides the count, not the server's speed
    r, rep = bench(port, "-m", "quant.per_tensor", "--input", "x=random:1x256:FP32", "--rate", "100",
                   "--duration", "1", "--warmup", "0.2")
    check(r.returncode == 0 and rep is not None and rep["mode"] == "open" and 80 <= rep["requests"] <= 120,
          f"open loop at 100/s for 1 s: about 100 requests ({rep and rep['requests']}: {r.stderr.strip()})")
    consistent(rep, "quant open loop")
    r, _ = bench(port, "-m", "quant.per_tensor", "--input", "x=random:2x64:FP32", "--requests", "10",
                 "--warmup", "0", json_out=False)
    check(r.returncode == 0 and "requests/s" in r.stdout and "p99" in r.stdout and "tokens/s" in r.stdout,
          f"the table names requests/s, tokens/s and p99 ({r.stdout.strip()})")


def test_fused_moe(port):
    r, rep = bench(port, "-m", "set", "--input", "hidden_states=random:4x128:BF16", "--input",
                   "router_logits=random:4x8:FP32", "--concurrency", "2", "--duration", "1", "--warmup", "0.2")
    check(r.returncode == 0, f"fused_moe expert set exits 0 ({r.returncode}: {r.stderr.strip()})")
    consistent(rep, "fused_moe expert set")


def test_stream(port):
    """--stream: ModelStreamInfer, one stream per request in flight."""
    r, rep = bench(port, "-m", "set", "--input", "hidden_states=random:2x128:BF16", "--input",
                   "router_logits=random:2x8:FP32", "--stream", "--concurrency", "3", "--channels", "2",
                   "--duration", "1", "--warmup", "0.2")
    check(r.returncode == 0 and rep is not None and rep["stream"] is True,
          f"--stream on an expert set exits 0 ({r.returncode}: {r.stderr.strip()})")
    consistent(rep, "--stream expert set")
    r, rep = bench(port, "-m", "quant.per_tensor", "--input", "x=random:1x64:FP32", "--stream", "--requests", "30",
                   "--concurrency", "2", "--warmup", "0")
    check(r.returncode == 0 and rep is not None and rep["requests"] == 30, "--stream --requests 30: exactly 30")
    consistent(rep, "--stream --requests", windows=False)
    # a stream's error reaches the client as a message only: counted UNKNOWN, the stream goes on
    r, rep = bench(port, "-m", "no-such-model", "--input", "x=random:1x64:FP32", "--stream", "--requests", "20",
                   "--warmup", "0")
    check(r.returncode == 1 and rep is not None and rep["errors_by_status"] == {"UNKNOWN": 20} and
          "not found" in rep.get("first_error", ""), f"--stream, a wrong model: 20 errors, exit 1 ({rep})")
    r, _ = bench(port, "-m", "quant.per_tensor", "--input", "x=random:1x64:FP32", "--stream", "--timeout-ms", "100")
    check(r.returncode == 2 and "--timeout-ms" in r.stderr, f"--stream with --timeout-ms: exit 2 ({r.stderr.strip()})")


def test_sweep(port, tmp):
    """A closed-loop sweep over three levels in short windows, written as
    JSON, CSV and SVG: the three agree, one row and one point per level."""
    out = {k: os.path.join(tmp, f"sweep.{k}") for k in ("json", "csv", "svg")}
    r, _ = bench(port, "-m", "set", "--input", "hidden_states=random:1x128:BF16", "--input",
                 "router_logits=random:1x8:FP32", "--concurrency", "1:5:2", "--channels", "2", "--window-ms", "150",
                 "--max-windows", "5", "--stability-pct", "50", "--warmup", "0.1", "--tokens", "1,2,4",
                 "--json", out["json"], "--csv", out["csv"], "--svg", out["svg"], json_out=False)
    check(r.returncode == 0, f"sweep 1:5:2 exits 0 ({r.returncode}: {r.stderr.strip()})")
    check("concurrency" in r.stdout and len([l for l in r.stdout.splitlines() if l.split()[:1] in (["1"], ["3"], ["5"])]) == 3,
          f"the table has a row per level ({r.stdout})")
    try:
        rep = json.load(open(out["json"]))
        rows = list(csv.DictReader(open(out["csv"])))
        svg = ET.parse(out["svg"]).getroot()
    except (OSError, ValueError, ET.ParseError) as e:
        check(False, f"sweep: JSON, CSV and SVG written and parsed ({e})")
        return
    levels = rep["levels"]
    check([lv["concurrency"] for lv in levels] == [1, 3, 5] and rep["tokens_spec"] == "1,2,4",
          f"sweep: levels 1, 3, 5 in order ({[lv['concurrency'] for lv in levels]})")
    for lv in levels:
        what = f"sweep concurrency {lv['concurrency']}"
        check(lv["requests"] > 0 and lv["ok"] == lv["requests"], f"{what}: all ok ({lv['requests']})")
        level_consistent(lv, what)
        n = len(lv["windows"])
        check(1 <= n <= 5 and (n >= 3 if lv["stable"] else n == 5),
              f"{what}: stable after >= 3 windows, else all 5 ({n}, {lv['stable']})")
        check(lv["ok"] <= lv["tokens"] <= 4 * lv["ok"] and lv["channels"] == min(2, lv["concurrency"]),
              f"{what}: 1 to 4 tokens per request, channels capped by the concurrency ({lv['tokens']}, {lv['ok']})")
    check(len(rows) == len(levels), f"CSV: one row per level ({len(rows)})")
    for row, lv in zip(rows, levels):
        same = (int(row["concurrency"]) == lv["concurrency"] and int(row["requests"]) == lv["requests"] and
                int(row["ok"]) == lv["ok"] and int(row["windows"]) == len(lv["windows"]) and
                int(row["server_requests"]) == lv["server"]["requests"] and
                abs(float(row["p99_ms"]) - lv["latency_ms"]["p99"]) < 1e-5 and
                abs(float(row["requests_per_s"]) - lv["requests_per_s"]) < 1e-2)
        check(same, f"CSV row {row['concurrency']} = its JSON level ({row})")
    ns = "{http://www.w3.org/2000/svg}"
    for cls in ("p50", "p99"):
        pts = [c for c in svg.iter(ns + "circle") if c.get("class") == cls]
        line = [p for p in svg.iter(ns + "polyline") if p.get("class") == cls]
        check(len(pts) == len(levels) and len(line) == 1 and len(line[0].get("points").split()) == len(levels),
              f"SVG: one {cls} point per level ({len(pts)})")
        if cls == "p99" and len(pts) == len(levels):  # a higher latency is drawn higher (smaller y)
            ys = [float(c.get("cy")) for c in pts]
            order = sorted(range(len(levels)), key=lambda i: levels[i]["latency_ms"]["p99"])
            check(all(ys[order[i]] >= ys[order[i + 1]] for i in range(len(order) - 1)), f"SVG: p99 points by latency ({ys})")
    # no stability search: exactly --max-windows windows
    r, rep = bench(port, "-m", "quant.per_token", "--input", "x=random:2x64:FP32", "--window-ms", "100",
                   "--max-windows", "2", "--stability-pct", "0", "--warmup", "0")
    check(r.returncode == 0 and rep is not None and len(rep["windows"]) == 2 and rep["stable"] is None,
          f"--stability-pct 0 --max-windows 2: two windows ({rep and len(rep['windows'])})")
    if rep:
        consistent(rep, "two fixed windows")


def test_tokens(port, tmp):
    """--tokens: each request carries one of the counts asked for; the
    server's row count (ModelStatistics inference_count, from the rows it
    received) agrees with the client's token count."""
    import tritonclient.grpc as tc
    cli = tc.InferenceServerClient(f"127.0.0.1:{port}")

    def rows():
        return int(cli.get_inference_statistics("quant.per_token").model_stats[0].inference_count)

    for spec, lo, hi in [("3", 3, 3), ("uniform:2:5", 2, 5), ("zipf:1.2:16", 1, 16)]:
        before = rows()
        r, rep = bench(port, "-m", "quant.per_token", "--input", "x=random:1x32:FP32", "--tokens", spec,
                       "--requests", "60", "--concurrency", "3", "--warmup", "0", "--seed", "7")
        after = rows()
        ok = r.returncode == 0 and rep is not None and rep["ok"] == 60
        check(ok and lo * 60 <= rep["tokens"] <= hi * 60 and after - before == rep["tokens"],
              f"--tokens {spec}: 60 requests of {lo}..{hi} tokens, as many rows reached the server "
              f"({rep and rep['tokens']}, {after - before}: {r.stderr.strip()})")
        if spec == "3" and rep:
            check(abs(rep["tokens_per_s"] - 3 * rep["requests_per_s"]) <= 1e-9 * rep["tokens_per_s"],
                  "--tokens 3: tokens/s = 3 x requests/s")
    x = np.zeros((4, 16), np.float32)
    np.save(os.path.join(tmp, "x4.npy"), x)
    r, _ = bench(port, "-m", "quant.per_token", "--input", f"x={tmp}/x4.npy", "--tokens", "2,8", "--requests", "5")
    check(r.returncode == 2 and "--tokens" in r.stderr and "4 rows" in r.stderr,
          f"--tokens beyond a .npy input's rows: exit 2 naming them ({r.stderr.strip()})")
    r, rep = bench(port, "-m", "quant.per_token", "--input", f"x={tmp}/x4.npy", "--tokens", "1,4", "--requests", "20",
                   "--warmup", "0")
    check(r.returncode == 0 and rep is not None and 20 <= rep["tokens"] <= 80,
          f"--tokens within a .npy input's rows: prefixes sent ({r.stderr.strip()})")
    # a .npy input longer than the largest count next to a random one: both cut to each request's count
    h = (np.random.default_rng(2).standard_normal((8, 128)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    np.save(os.path.join(tmp, "h8.npy"), h)
    r, rep = bench(port, "-m", "set", "--input", f"hidden_states={tmp}/h8.npy:BF16", "--input",
                   "router_logits=random:8x8:FP32", "--tokens", "1,3", "--requests", "20", "--warmup", "0")
    check(r.returncode == 0 and rep is not None and rep["ok"] == 20 and 20 <= rep["tokens"] <= 60,
          f"--tokens over a .npy and a random input of 8 rows: every request consistent ({r.stderr.strip()})")


def test_variants(port, tmp):
    """--variants N: each request is one of N row blocks of the inputs,
    drawn evenly. Row block 0 of topk_ids routes to valid experts, block 1
    to expert 8 of 8 (INVALID_ARGUMENT): about half the requests fail, all
    with that status, and none without --variants (block 0 only)."""
    rng = np.random.default_rng(3)
    h = (rng.standard_normal((4, 128)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    ids = np.array([[0, 1], [2, 3], [8, 0], [1, 8]], np.int32)  # rows 2, 3: expert 8 does not exist
    np.save(os.path.join(tmp, "vh.npy"), h)
    np.save(os.path.join(tmp, "vids.npy"), ids)
    np.save(os.path.join(tmp, "vw.npy"), np.full((4, 2), 0.5, np.float32))
    inputs = ["--input", f"hidden_states={tmp}/vh.npy:BF16", "--input", f"topk_ids={tmp}/vids.npy",
              "--input", f"topk_weights={tmp}/vw.npy"]
    r, rep = bench(port, "-m", "set", *inputs, "--tokens", "2", "--requests", "40", "--warmup", "0")
    check(r.returncode == 0 and rep is not None and rep["ok"] == 40 and rep["variants"] == 1,
          f"--tokens 2 without --variants: rows 0-1 only, all ok ({r.stderr.strip()})")
    r, rep = bench(port, "-m", "set", *inputs, "--tokens", "2", "--variants", "2", "--requests", "200",
                   "--concurrency", "4", "--warmup", "0")
    bad = rep and rep["errors_by_status"].get("INVALID_ARGUMENT", 0)
    check(r.returncode == 1 and rep is not None and rep["variants"] == 2 and rep["requests"] == 200 and
          rep["errors"] == bad and 60 <= bad <= 140 and rep["tokens"] == 2 * rep["ok"],
          f"--variants 2: rows 2-3 sent by about half the requests, each refused ({rep and rep['errors_by_status']})")
    r, rep = bench(port, "-m", "set", "--input", "hidden_states=random:1x128:BF16", "--input",
                   "router_logits=random:1x8:FP32", "--tokens", "1,2", "--variants", "16", "--requests", "50",
                   "--warmup", "0")
    check(r.returncode == 0 and rep is not None and rep["ok"] == 50 and 50 <= rep["tokens"] <= 100,
          f"--variants 16 over random inputs (made 32 rows long): all ok ({r.stderr.strip()})")
    for args, flag, say in [(["--variants", "2"], "--variants", "--tokens"),
                            (["--variants", "0", "--tokens", "1"], "--variants", "1.."),
                            (["--variants", "3", "--tokens", "2"], "--tokens", "4 rows")]:
        r, _ = bench(port, "-m", "set", *inputs, *args, "--requests", "5")
        check(r.returncode == 2 and flag in r.stderr and say in r.stderr,
              f"{' '.join(args)}: exit 2 naming {flag} ({r.stderr.strip()})")


def test_no_statistics():
    """A server that answers ModelInfer but never ModelStatistics (as a bare
    gRPC echo server, bench/echo_server.c, which leaves unregistered methods
    waiting): the bench measures it and gives up the breakdown after 2 s,
    instead of waiting forever."""
    from concurrent import futures
    import threading
    import time
    import grpc
    stop = threading.Event()

    def statistics(req, ctx):
        stop.wait(60)
        return b""

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("inference.GRPCInferenceService", {
        "ModelInfer": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req),
        "ModelStatistics": grpc.unary_unary_rpc_method_handler(statistics)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        t0 = time.monotonic()
        r, rep = bench(port, "-m", "echo", "--input", "x=random:4x256:FP32", "--requests", "20", "--warmup", "0")
        took = time.monotonic() - t0
        check(r.returncode == 0 and rep is not None and rep["ok"] == 20 and rep["server"] is None and
              "no server-side breakdown" in r.stderr and took < 15,
              f"no ModelStatistics answer: 20 echoed requests measured, no breakdown, in {took:.1f} s "
              f"({r.stderr.strip()})")
        if rep:
            check(rep["received_bytes_per_s"] == rep["sent_bytes_per_s"], "the echo's bytes counted as received")
    finally:
        stop.set()
        server.stop(0)


def test_help():
    """`moec bench --help` documents every flag bench takes."""
    r = subprocess.run([MOEC, "bench", "--help"], capture_output=True, text=True, timeout=10)
    flags = ["-m MODEL", "--input", "--param", "--concurrency", "--channels", "--rate", "--poisson", "--warmup",
             "--window-ms", "--stability-pct", "--max-windows", "--duration", "--requests", "--tokens", "--variants", "--seed",
             "--stream", "--json", "--csv", "--svg", "--timeout-ms", "--tls-ca", "--tls-cert", "--tls-key",
             "--token-file", "-a HOST:PORT"]
    missing = [f for f in flags if f not in r.stdout]
    check(r.returncode == 0 and not missing, f"moec bench --help documents every flag (missing {missing})")


def test_errors(port):
    r, rep = bench(port, "-m", "no-such-model", "--input", "x=random:1x64:FP32", "--duration", "0.5",
                   "--warmup", "0")
    ok = r.returncode == 1 and rep is not None and rep["requests"] > 0 and rep["ok"] == 0 and \
        rep["errors"] == rep["requests"] and rep["errors_by_status"] == {"NOT_FOUND": rep["requests"]}
    check(ok, f"a wrong model: every request counted NOT_FOUND, exit 1 ({r.returncode}: {rep})")
    check("NOT_FOUND" in r.stderr, f"a wrong model: said on stderr ({r.stderr.strip()})")
    for args, flag in [(["--concurrency", "0"], "--concurrency"), (["--rate", "fast"], "--rate"),
                       (["--duration", "-1"], "--duration"), (["--requests", "1.5"], "--requests"),
                       (["--poisson"], "--poisson"), (["--warmup", "x"], "--warmup"),
                       (["--concurrency", "3:1"], "--concurrency"), (["--concurrency", "1:4:0"], "--concurrency"),
                       (["--concurrency", "1,,2"], "--concurrency"), (["--rate", "10", "--concurrency", "1:2"], "--concurrency"),
                       (["--duration", "1", "--window-ms", "100"], "--duration"),
                       (["--requests", "5", "--max-windows", "2"], "--requests"),
                       (["--window-ms", "0"], "--window-ms"), (["--stability-pct", "101"], "--stability-pct"),
                       (["--max-windows", "0"], "--max-windows"), (["--tokens", "0"], "--tokens"),
                       (["--tokens", "uniform:8:2"], "--tokens"), (["--tokens", "zipf:0:8"], "--tokens"),
                       (["--tokens", "triangle:1:4"], "--tokens"), (["--seed", "-1"], "--seed")]:
        r, _ = bench(port, "-m", "quant.per_tensor", "--input", "x=random:1x64:FP32", *args)
        check(r.returncode == 2 and flag in r.stderr, f"bad {' '.join(args)}: exit 2 naming {flag} ({r.stderr.strip()})")
    for spec in ["x=random:4q:FP32", "x=random:4x8:FP99", "x=random:4x8"]:
        r, _ = bench(port, "-m", "quant.per_tensor", "--input", spec)
        check(r.returncode == 2 and spec.split("=")[1] in r.stderr, f"bad --input {spec}: exit 2 naming it ({r.stderr.strip()})")
    for flag in ("--json", "--csv", "--svg"):
        r, _ = bench(port, "-m", "quant.per_tensor", "--input", "x=random:1x64:FP32", flag, "/nonexistent/dir/out",
                     json_out=False)
        check(r.returncode == 2 and flag in r.stderr and "/nonexistent/dir/out" in r.stderr,
              f"an unwritable {flag} path: exit 2 before the sweep ({r.stderr.strip()})")
    r, _ = bench(port, "--input", "x=random:1x64:FP32")
    check(r.returncode == 2 and "-m MODEL" in r.stderr, "bench without -m: exit 2")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        repo = os.path.join(tmp, "repo")
        os.makedirs(repo)
        subprocess.run([MKSET, "--out", f"{repo}/set", "--scheme", "bf16", "--experts", "8", "--hidden", "128",
                        "--intermediate", "64", "--top-k", "2"], check=True, capture_output=True)
        with moed(tmp, "--model-repository", repo) as (_, port, _):
            test_quant(port, tmp)
            test_fused_moe(port)
            test_stream(port)
            test_sweep(port, tmp)
            test_tokens(port, tmp)
            test_variants(port, tmp)
            test_errors(port)
            test_help()
        test_no_statistics()
        print_log_tail(tmp)
    exit_with_summary()


if __name__ == "__main__":
    main()
