"""Integration test: batches grow while the device is busy (batcher.c).

At --max-queue-delay-us 0 with one worker, a batch whose delay has passed
stays open in the batcher while the worker runs and work of its level
already waits in the device queue, so requests that arrive meanwhile join
it: 32 concurrent callers of an expert set (one token each) run in far
fewer executions than requests, batch sizes above 1 appear in
ModelStatistics, and every answer is bit-identical to the same request
run alone. A request held that way is answered at its `timeout`
(DEADLINE_EXCEEDED) and leaves the batcher when its call is cancelled,
while the worker is still busy; held requests merge into one execution
once the worker is free (the blocker ahead of them cancelled); and a SIGTERM drain answers the held requests
(a drain that lets them run: OK; one whose timeout stops the work:
every call answered, moed exits within the bound).

env: MOED, MOEC, MOE_LIB, MOE_MKSET."""
import os
import signal
import sys
import tempfile
import threading
import time

import grpc
import tritonclient.grpc as tc

sys.path.insert(0, os.path.dirname(__file__))
from moed_process import check, exit_with_summary, moed, print_log_tail  # noqa: E402
import test_server as ts  # noqa: E402
from long_call import bigset_repo, blocker, call_fn, channel, req_of, wait_metric  # noqa: E402
from test_server import code_of  # noqa: E402

SC = grpc.StatusCode
HELD = "moed_batcher_requests "
QUEUED = "moed_device_queue_jobs{"
CLIENTS, PER_CLIENT = 32, 3


def outputs(raw):
    """A ModelInfer response's output bytes, by output name."""
    resp = ts.pb.ModelInferResponse.FromString(raw)
    return {o.name: bytes(c) for o, c in zip(resp.outputs, resp.raw_output_contents)}


def batch_sizes(port):
    st = tc.InferenceServerClient(f"127.0.0.1:{port}").get_inference_statistics("bigset").model_stats[0]
    return {int(b.batch_size): int(b.compute_infer.count) for b in st.batch_stats}, st


def alone(f, seeds):
    """Each request run alone (one after another: nothing to merge with)."""
    ref = {}
    for s in seeds:
        ref[s] = outputs(f(req_of(1, seed=s), timeout=120))
    return ref


def test_merge_under_load(tmp, repo):
    with moed(tmp, "--model-repository", repo, "--workers", "1", "--max-queue-delay-us", "0") as (_, port, _h):
        f = call_fn(channel(port))
        seeds = [100 + k for k in range(CLIENTS * PER_CLIENT)]
        ref = alone(f, seeds)
        sizes0, st0 = batch_sizes(port)
        got, errs = {}, []
        start = threading.Barrier(CLIENTS)

        def client(c):
            g = call_fn(channel(port))
            start.wait()
            for s in seeds[c::CLIENTS]:
                try:
                    got[s] = outputs(g(req_of(1, seed=s), timeout=300))
                except grpc.RpcError as e:
                    errs.append(f"{s}: {e.code()} {e.details()}")
        threads = [threading.Thread(target=client, args=(c,)) for c in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        check(not errs, f"every concurrent call answered OK ({errs[:3]})")
        same = [s for s in seeds if got.get(s) == ref[s]]
        check(len(same) == len(seeds), f"{len(same)} of {len(seeds)} answers bit-identical to the request alone")
        sizes1, st1 = batch_sizes(port)
        runs = st1.execution_count - st0.execution_count
        rows = st1.inference_count - st0.inference_count
        new = {k: v - sizes0.get(k, 0) for k, v in sizes1.items() if v != sizes0.get(k, 0)}
        check(rows == len(seeds) and sum(k * n for k, n in new.items()) == rows,
              f"the {len(seeds)} rows counted once each ({rows}, batch sizes {new})")
        check(max(new) > 1 and runs <= len(seeds) // 3,
              f"delay 0, one busy worker: {len(seeds)} requests in {runs} executions, batch sizes {new}")


def test_held(tmp, repo):
    with moed(tmp, "--model-repository", repo, "--workers", "1", "--max-queue-delay-us", "0") as (_, port, http_port):
        f = call_fn(channel(port))
        ref = alone(f, [1, 4, 5])
        busy = blocker(f, http_port)
        queued = f.future(req_of(1, seed=1), timeout=3600)  # nothing waits: it goes to the device queue
        wait_metric(http_port, QUEUED, 1, "the first request waits in the device queue")
        t0 = time.monotonic()
        expiring = f.future(req_of(1, seed=2, params={"timeout": 500_000}), timeout=3600)
        wait_metric(http_port, HELD, 1, "the next is held in the batcher (delay 0, worker busy, queue not empty)")
        code, msg = code_of(expiring.result)
        t = time.monotonic() - t0
        check(code == SC.DEADLINE_EXCEEDED and "parameters['timeout']" in msg and not busy.done(),
              f"a held request past its timeout (0.5 s): DEADLINE_EXCEEDED in {t:.2f}s, the worker still busy "
              f"({code} {msg})")
        wait_metric(http_port, HELD, 0, "the expired request left the batcher")
        cancelled = f.future(req_of(1, seed=3), timeout=3600)
        wait_metric(http_port, HELD, 1, "a request held")
        cancelled.cancel()
        wait_metric(http_port, HELD, 0, "a cancelled held request leaves the batcher at once")
        check(not busy.done(), "... while the worker is still busy")
        sizes0, _ = batch_sizes(port)
        late = [f.future(req_of(1, seed=s), timeout=3600) for s in (4, 5)]
        wait_metric(http_port, HELD, 2, "two requests held in one open batch")
        check(not busy.done(), "... the worker still busy with the blocker")
        busy.cancel()  # the worker stops it at its next work item and takes the queue
        for name, fut, s in (("queued", queued, 1), ("held 4", late[0], 4), ("held 5", late[1], 5)):
            code, msg = code_of(fut.result)
            check(code == SC.OK and outputs(fut.result()) == ref[s],
                  f"{name}: OK and bit-identical to the request alone ({code} {msg})")
        sizes1, _ = batch_sizes(port)
        check(sizes1.get(2, 0) - sizes0.get(2, 0) == 1,
              f"the two held requests ran as one execution of 2 rows ({sizes0} -> {sizes1})")
        wait_metric(http_port, "moed_inflight_requests ", 0, "nothing left in flight")


def test_drain_held(tmp, repo):
    """SIGTERM with held batches: a drain long enough runs them (OK) once
    the blocker ahead of them is cancelled; one whose timeout passes first
    answers every call and exits in bound."""
    for drain_s, want in ((60.0, {SC.OK}), (0.5, {SC.OK, SC.UNAVAILABLE})):
        with moed(tmp, "--model-repository", repo, "--workers", "1", "--max-queue-delay-us", "0",
                  "--drain-timeout", str(drain_s), exit_check=None) as (p, port, http_port):
            f = call_fn(channel(port))
            ref = alone(f, [7, 8])
            busy = blocker(f, http_port)
            queued = f.future(req_of(1, seed=6), timeout=3600)
            wait_metric(http_port, QUEUED, 1, "one request in the device queue")
            held = [f.future(req_of(1, seed=s), timeout=3600) for s in (7, 8)]
            wait_metric(http_port, HELD, 2, "two requests held in the batcher")
            t0 = time.monotonic()
            p.send_signal(signal.SIGTERM)
            if drain_s > 1:  # once draining, the worker is let go: the drain runs what is queued and held
                wait_metric(http_port, "moed_ready ", 0, f"drain {drain_s}s: not ready")
                check(not busy.done(), f"drain {drain_s}s: the blocker still running when the drain began")
                busy.cancel()
            rc = p.wait(timeout=120)
            t = time.monotonic() - t0
            check(rc == 0 and t < drain_s + 3.0, f"drain {drain_s}s: exit {rc} in {t:.2f}s")
            codes = [code_of(fut.result)[0] for fut in [queued] + held]
            check(all(c in want for c in codes), f"drain {drain_s}s: every call answered, {want} ({codes})")
            code = SC.CANCELLED if busy.cancelled() else code_of(busy.result)[0]
            check(code == (SC.CANCELLED if drain_s > 1 else SC.UNAVAILABLE),
                  f"drain {drain_s}s: the blocker cancelled, or stopped by the drain timeout ({code})")
            for fut, s in zip(held, (7, 8)):
                if code_of(fut.result)[0] == SC.OK:
                    check(outputs(fut.result()) == ref[s], f"drain {drain_s}s: held request {s} bit-identical")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        repo = bigset_repo(tmp)
        test_merge_under_load(tmp, repo)
        test_held(tmp, repo)
        test_drain_held(tmp, repo)
        print_log_tail(tmp)
    exit_with_summary()


if __name__ == "__main__":
    main()
