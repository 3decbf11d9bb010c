"""Integration test: moed's /metrics histograms and gauges against a real
moed on a free loopback port, loaded by `moec bench`.

After a known number of requests with a known number of rows each, per
model: the batch-size histogram's _count is the number of executions
ModelStatistics reports (execution_count, and the sum of its batch_stats
counts), its _sum is the rows sent (requests x rows, worked out here), each
bucket holds exactly the batch_stats executions of sizes up to its bound,
buckets are cumulative and monotone with +Inf = _count; the queue-time
histogram counts every success. While requests wait in open batches (a
long max_queue_delay_us) the batcher gauge shows them; idle, every queue
gauge is 0; CPU workers show no device memory sample. Per worker (device):
moed_worker_jobs_total counts the jobs each ran (30 lone requests: 30 jobs
over the workers, as many as ModelStatistics' executions), moed_worker_busy
is 0 or 1, sums to moed_batches_in_flight in every scrape, and shows the
worker running a long request; moed_worker_executions_total counts the
op calls (30 lone requests: 30; merged load: the models' executions) and
moed_worker_phase_seconds_total has every phase per worker, counting up.

env: MOED, MOEC, MOE_MKSET."""
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import tritonclient.grpc as tc

sys.path.insert(0, os.path.dirname(__file__))
from moed_process import check, exit_with_summary, moed, print_log_tail  # noqa: E402

MOEC, MKSET = os.environ["MOEC"], os.environ["MOE_MKSET"]
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def scrape(http_port):
    """[(name, {label: value}, value)] of every sample line."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10).read().decode()
    out = []
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m and not line.startswith("#"):
            out.append((m.group(1), dict(LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return text, out


def value(samples, name, **labels):
    vals = [v for n, l, v in samples if n == name and all(l.get(k) == w for k, w in labels.items())]
    return vals[0] if len(vals) == 1 else None


def bench(port, model, inputs, requests, concurrency):
    args = [MOEC, "-a", f"127.0.0.1:{port}", "bench", "-m", model, "--requests", str(requests), "--concurrency",
            str(concurrency), "--warmup", "0"]
    for i in inputs:
        args += ["--input", i]
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def batch_histogram(port, http_port, model, requests, rows):
    """model ran `requests` requests of `rows` rows each, nothing else."""
    st = tc.InferenceServerClient(f"127.0.0.1:{port}").get_inference_statistics(model).model_stats[0]
    text, s = scrape(http_port)
    check(f"# TYPE moed_batch_size histogram" in text, "moed_batch_size typed as a histogram")
    buckets = [(float(l["le"]), v) for n, l, v in s if n == "moed_batch_size_bucket" and l.get("model") == model]
    count, total = value(s, "moed_batch_size_count", model=model), value(s, "moed_batch_size_sum", model=model)
    les = [le for le, _ in buckets]
    check(len(buckets) == 16 and les == sorted(les) and les[-1] == float("inf"),
          f"{model}: 16 buckets in increasing order ending at +Inf ({les})")
    vals = [v for _, v in buckets]
    check(all(a <= b for a, b in zip(vals, vals[1:])) and vals[-1] == count,
          f"{model}: buckets cumulative and monotone, +Inf = _count ({vals}, {count})")
    sizes = {int(b.batch_size): int(b.compute_infer.count) for b in st.batch_stats}
    check(count == st.execution_count == sum(sizes.values()) and count > 0,
          f"{model}: _count = executions in ModelStatistics ({count}, {st.execution_count}, {sum(sizes.values())})")
    check(total == requests * rows == sum(k * n for k, n in sizes.items()) == st.inference_count,
          f"{model}: _sum = the rows sent, {requests} x {rows} ({total}, batch_stats {sizes})")
    want = [sum(n for k, n in sizes.items() if k <= le) for le in les]
    check(vals == want, f"{model}: each bucket = the executions of sizes up to its bound ({vals} vs {want})")
    q = value(s, "moed_queue_seconds_count", model=model)
    qsum = value(s, "moed_queue_seconds_sum", model=model)
    check(q == requests == st.inference_stats.success.count and
          abs(qsum - st.inference_stats.queue.ns / 1e9) <= 1e-6 * max(1.0, qsum),
          f"{model}: queue-time histogram counts every success, sum = ModelStatistics queue ({q}, {qsum})")
    return sizes


def idle_gauges(http_port, what):
    """A worker answers a request before its job returns: the gauges get
    a moment to settle."""
    for _ in range(100):
        _, s = scrape(http_port)
        got = {f"priority {p}": value(s, "moed_device_queue_jobs", priority=str(p)) for p in (1, 2, 3)}
        got["in flight"] = value(s, "moed_batches_in_flight")
        got["batcher"] = value(s, "moed_batcher_requests")
        if all(v == 0 for v in got.values()):
            break
        time.sleep(0.02)
    check(all(v == 0 for v in got.values()), f"{what}: every queue gauge present and 0 ({got})")


def test_histograms(tmp, repo):
    with moed(tmp, "--model-repository", repo, "--max-batch-tokens", "64",
              "--max-queue-delay-us", "2000") as (_, port, http_port):
        idle_gauges(http_port, "idle at start")
        text, s = scrape(http_port)
        check("# TYPE moed_device_memory_bytes gauge" in text and
              not [n for n, _, _ in s if n == "moed_device_memory_bytes"],
              "CPU workers: no device memory samples (host memory)")
        r = bench(port, "set", ["hidden_states=random:4x128:BF16", "router_logits=random:4x8:FP32"], 120, 8)
        check(r.returncode == 0, f"120 requests of 4 rows to the expert set ({r.stderr.strip()})")
        sizes = batch_histogram(port, http_port, "set", 120, 4)
        print(f"info: set batch sizes {sizes}")
        r = bench(port, "quant.per_token", ["x=random:3x64:FP32"], 90, 6)
        check(r.returncode == 0, f"90 requests of 3 rows to quant.per_token ({r.stderr.strip()})")
        batch_histogram(port, http_port, "quant.per_token", 90, 3)
        idle_gauges(http_port, "idle after the load")
        # merged batches: the workers' executions are the models' (each batch one op call)
        cli = tc.InferenceServerClient(f"127.0.0.1:{port}")
        ex = sum(cli.get_inference_statistics(m).model_stats[0].execution_count for m in ("set", "quant.per_token"))
        _, s = scrape(http_port)
        execs = [v for n, _, v in s if n == "moed_worker_executions_total"]
        check(execs and sum(execs) == ex, f"moed_worker_executions_total sums to the executions ({execs}, {ex})")
        # merged batches' responses go to an answer thread only where one was asked for (CPU workers: by env)
        asynced = sum(v for n, l, v in s if n == "moed_worker_phase_seconds_total" and l.get("phase") == "answer_async")
        threaded = os.environ.get("MOED_ANSWER_THREAD") == "1"
        check(asynced > 0 if threaded else asynced == 0,
              f"answer_async {asynced} s: {'> 0 (MOED_ANSWER_THREAD=1)' if threaded else '0 (CPU workers answer inline)'}")


def workers(samples, name):
    """{worker: value} of a per-worker metric; its backend label checked."""
    got = {l["worker"]: v for n, l, v in samples if n == name and l.get("backend", "").startswith("cpu")}
    return got if len(got) == len([1 for n, _, _ in samples if n == name]) else None


PHASES = ("gather", "prepare", "copy_in", "launch", "copy_out", "wait", "answer", "answer_async")


def phase_sums(samples):
    """{worker: {phase: seconds}} of moed_worker_phase_seconds_total; None unless every worker has each
    phase exactly once (and nothing else)."""
    got = {}
    for n, l, v in samples:
        if n == "moed_worker_phase_seconds_total":
            if l.get("phase") not in PHASES or l.get("phase") in got.get(l.get("worker"), {}):
                return None
            got.setdefault(l.get("worker"), {})[l["phase"]] = v
    return got if got and all(len(p) == len(PHASES) for p in got.values()) else None


def test_workers(tmp, repo):
    """Per-device samples: one per worker, labelled with its backend."""
    with moed(tmp, "--model-repository", repo, "--workers", "2") as (_, port, http_port):
        idle_gauges(http_port, "idle at start (2 workers)")
        text, s = scrape(http_port)
        jobs0, busy = workers(s, "moed_worker_jobs_total"), workers(s, "moed_worker_busy")
        check("# TYPE moed_worker_jobs_total counter" in text and "# TYPE moed_worker_busy gauge" in text and
              jobs0 is not None and set(jobs0) == {"0", "1"} and busy == {"0": 0, "1": 0},
              f"one jobs counter and one busy gauge per worker, labelled worker and backend ({jobs0}, {busy})")
        execs0, phases0 = workers(s, "moed_worker_executions_total"), phase_sums(s)
        check("# TYPE moed_worker_executions_total counter" in text and
              "# TYPE moed_worker_phase_seconds_total counter" in text and execs0 == {"0": 0, "1": 0} and
              phases0 is not None and all(v == 0 for w in phases0.values() for v in w.values()),
              f"per worker an executions counter and one phase counter per phase, all 0 ({execs0}, {phases0})")
        cli = tc.InferenceServerClient(f"127.0.0.1:{port}")
        ex0 = cli.get_inference_statistics("set").model_stats[0].execution_count
        # one at a time: each request its own batch, its own job
        r = bench(port, "set", ["hidden_states=random:2x128:BF16", "router_logits=random:2x8:FP32"], 30, 1)
        check(r.returncode == 0, f"30 requests one at a time ({r.stderr.strip()})")
        idle_gauges(http_port, "idle after 30 requests")
        _, s = scrape(http_port)
        jobs = workers(s, "moed_worker_jobs_total")
        ex = cli.get_inference_statistics("set").model_stats[0].execution_count - ex0
        ran = sum(jobs[w] - jobs0[w] for w in jobs) if jobs and jobs0 else None
        check(ran == 30 == ex, f"30 lone requests: 30 jobs over the workers, as many executions ({jobs}, {ex})")
        execs = workers(s, "moed_worker_executions_total")
        ran_ex = sum(execs[w] - execs0[w] for w in execs) if execs and execs0 else None
        check(ran_ex == 30, f"moed_worker_executions_total: the 30 executions over the workers ({execs0} -> {execs})")
        phases1 = phase_sums(s)
        check(phases1 is not None and all(phases1[w][p] >= phases0[w][p] for w in phases1 for p in PHASES) and
              all(sum(phases1[w].values()) > sum(phases0[w].values()) for w in phases1 if execs[w] > execs0[w]),
              f"moed_worker_phase_seconds_total: every phase counts up, a worker that ran has spent time "
              f"({phases0} -> {phases1})")
        # a long request (a 128 MiB activation, decoded and run on a worker) keeps one busy a while:
        # every scrape's busy gauges sum to moed_batches_in_flight; one shows it running
        done = threading.Event()

        def load():
            bench(port, "quant.per_token", ["x=random:4096x8192:FP32"], 6, 1)
            done.set()

        t = threading.Thread(target=load)
        t.start()
        seen, agree = set(), True
        while not done.is_set():
            _, s = scrape(http_port)
            busy, running = workers(s, "moed_worker_busy"), value(s, "moed_batches_in_flight")
            agree &= busy is not None and all(v in (0, 1) for v in busy.values()) and sum(busy.values()) == running
            seen |= {w for w, v in (busy or {}).items() if v == 1}
            time.sleep(0.005)
        t.join()
        check(agree, "in every scrape each worker's busy gauge is 0 or 1 and they sum to moed_batches_in_flight")
        check(len(seen) >= 1, f"a worker seen busy with a long request ({seen})")
        idle_gauges(http_port, "idle after the long requests")
        _, s = scrape(http_port)
        check(workers(s, "moed_worker_busy") == {"0": 0, "1": 0}, "idle: no worker busy")


def test_batcher_gauge(tmp, repo):
    """Requests wait up to 50 ms in an open batch: scrapes during the load
    see some held, never more than are in flight."""
    with moed(tmp, "--model-repository", repo, "--max-batch-tokens", "4096",
              "--max-queue-delay-us", "50000") as (_, port, http_port):
        seen, in_flight = [], []
        done = threading.Event()

        def load():
            bench(port, "set", ["hidden_states=random:1x128:BF16", "router_logits=random:1x8:FP32"], 200, 8)
            done.set()

        t = threading.Thread(target=load)
        t.start()
        while not done.is_set():
            _, s = scrape(http_port)
            seen.append(value(s, "moed_batcher_requests"))
            in_flight.append(value(s, "moed_batches_in_flight"))
            time.sleep(0.01)
        t.join()
        check(max(seen) >= 1 and all(0 <= v <= 8 for v in seen),
              f"under load: requests held in open batches seen, at most the 8 in flight (max {max(seen)})")
        check(all(0 <= v <= 2 for v in in_flight), f"batches in flight at most the 2 workers ({max(in_flight)})")
        idle_gauges(http_port, "idle after the batched load")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        repo = os.path.join(tmp, "repo")
        os.makedirs(repo)
        subprocess.run([MKSET, "--out", f"{repo}/set", "--scheme", "bf16", "--experts", "8", "--hidden", "128",
                        "--intermediate", "64", "--top-k", "2"], check=True, capture_output=True)
        test_histograms(tmp, repo)
        test_batcher_gauge(tmp, repo)
        test_workers(tmp, repo)
        print_log_tail(tmp)
    exit_with_summary()


if __name__ == "__main__":
    main()
