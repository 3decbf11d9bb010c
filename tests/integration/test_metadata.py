"""Integration test: what stock Triton clients read from moed is true.
ModelMetadata (rank and fixed dims of every tensor, the dtype an expert set
computes in, no input a set rejects), ModelConfig (max_batch_size and
dynamic_batching from the server's flags) and ModelStatistics (the four
counts perf_analyzer compares, with compute_input / compute_output timed),
against a real moed on a free loopback port, called by tritonclient.

env: MOED, MOEC, MOE_LIB, MOE_MKSET."""
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import tempfile

import grpc
import numpy as np
import tritonclient.grpc as tc

sys.path.insert(0, os.path.dirname(__file__))
from moed_process import check, exit_with_summary  # noqa: E402
import test_server as ts  # noqa: E402
from test_server import bf16, code_of, infer_pb, make_req  # noqa: E402

MKSET = os.environ["MOE_MKSET"]
HIDDEN, EXPERTS = 128, 8
MAX_BATCH, DELAY_US, QUEUE = 512, 3000, 77


def mkset(path, scheme):
    subprocess.run([MKSET, "--out", path, "--scheme", scheme, "--experts", str(EXPERTS), "--hidden", str(HIDDEN),
                    "--intermediate", "64", "--top-k", "2"], check=True, capture_output=True)


def shapes(tensors):
    return {t.name: (t.datatype, list(t.shape)) for t in tensors}


def test_quant_metadata(cli):
    m = cli.get_model_metadata("quant.per_tensor")
    ins, outs = shapes(m.inputs), shapes(m.outputs)
    check(ins == {"x": ("FP32", [-1, -1]), "scale": ("FP32", [1])},
          f"quant.per_tensor inputs: rank 2 x, [1] scale ({ins})")
    check(outs.get("q", (None, None))[1] == [-1, -1] and outs.get("scale") == ("FP32", [1]),
          f"quant.per_tensor outputs: rank 2 q, [1] scale ({outs})")
    m = cli.get_model_metadata("quant.per_token")
    check(shapes(m.outputs)["scales"][1] == [-1, 1], f"quant.per_token scales [-1, 1] ({shapes(m.outputs)})")
    m = cli.get_model_metadata("moe.topk")
    check(shapes(m.inputs) == {"router_logits": ("FP32", [-1, -1]), "correction_bias": ("FP32", [-1])},
          f"moe.topk inputs: [T, E] logits, [E] bias ({shapes(m.inputs)})")


def test_quant_config(cli):
    # quant.per_tensor: the dynamic scale depends on the whole tensor, never merged
    c = cli.get_model_config("quant.per_tensor").config
    dims = {i.name: list(i.dims) for i in c.input}
    check(c.max_batch_size == 0 and not c.HasField("dynamic_batching"),
          f"quant.per_tensor: max_batch_size 0, no dynamic_batching ({c.max_batch_size})")
    check(dims == {"x": [-1, -1], "scale": [1]}, f"quant.per_tensor dims are the full shapes ({dims})")
    check([i.optional for i in c.input] == [False, True], "quant.per_tensor scale optional")
    # the protocol has one datatype per tensor; every accepted one is listed in a parameter
    types = json.loads(c.parameters["datatypes"].string_value)
    check(types == {"x": ["FP32", "FP16", "BF16"], "q": ["UINT8", "INT8"]},
          f"quant.per_tensor datatypes parameter lists every accepted dtype ({types})")
    # quant.mx is merged along T: batch axis reported, and left out of dims
    c = cli.get_model_config("quant.mx").config
    check(c.max_batch_size == MAX_BATCH, f"quant.mx max_batch_size = --max-batch-tokens ({c.max_batch_size})")
    db = c.dynamic_batching
    check(c.HasField("dynamic_batching") and db.max_queue_delay_microseconds == DELAY_US,
          f"quant.mx dynamic_batching delay = --max-queue-delay-us ({c.dynamic_batching})")
    check(list(db.preferred_batch_size) == [MAX_BATCH] and db.priority_levels == 3 and
          db.default_priority_level == 2 and db.default_queue_policy.allow_timeout_override and
          db.default_queue_policy.max_queue_size == QUEUE,
          f"quant.mx dynamic_batching: preferred size, priority levels, queue policy from the flags ({db})")
    check([list(i.dims) for i in c.input] == [[-1]] and {o.name: list(o.dims) for o in c.output} ==
          {"q": [-1], "scales": [-1]}, "quant.mx dims without the batch axis")
    # moe.topk merges too, but its [E] bias has no batch axis: none reported
    c = cli.get_model_config("moe.topk").config
    check(c.max_batch_size == 0 and not c.HasField("dynamic_batching"), "moe.topk: no batch axis (bias is [E])")
    # the built-in fused_moe carries its weights: never merged
    c = cli.get_model_config("fused_moe").config
    check(c.max_batch_size == 0, "built-in fused_moe: max_batch_size 0")
    w13 = [list(i.dims) for i in c.input if i.name == "w13"]
    check(w13 == [[-1, -1, -1]], f"built-in fused_moe w13 rank 3 ({w13})")


def test_set_metadata(cli, ch):
    m = cli.get_model_metadata("bf16set")
    ins, outs = shapes(m.inputs), shapes(m.outputs)
    want = {"hidden_states": ("BF16", [-1, HIDDEN]), "router_logits": ("FP32", [-1, EXPERTS]),
            "topk_ids": ("INT32", [-1, -1]), "topk_weights": ("FP32", [-1, -1])}
    check(ins == want, f"bf16 set inputs: ranks, fixed H and E, no weights or correction_bias ({ins})")
    check(outs == {"output": ("BF16", [-1, HIDDEN])}, f"bf16 set output BF16 [-1, H] ({outs})")
    check(not any(dt == "FP16" for dt, _ in list(ins.values()) + list(outs.values())), "bf16 set advertises no FP16")
    m = cli.get_model_metadata("fp16set")
    check(shapes(m.inputs)["hidden_states"] == ("FP16", [-1, HIDDEN]) and
          shapes(m.outputs)["output"] == ("FP16", [-1, HIDDEN]), "fp16 set advertises FP16")
    c = cli.get_model_config("bf16set").config
    dims = {i.name: list(i.dims) for i in c.input}
    check(c.max_batch_size == MAX_BATCH and c.dynamic_batching.max_queue_delay_microseconds == DELAY_US,
          f"bf16 set max_batch_size and dynamic_batching ({c.max_batch_size})")
    check(dims == {"hidden_states": [HIDDEN], "router_logits": [EXPERTS], "topk_ids": [-1], "topk_weights": [-1]},
          f"bf16 set config dims without the batch axis ({dims})")
    check({i.name: i.data_type for i in c.input}["hidden_states"] == tc.model_config_pb2.TYPE_BF16,
          "bf16 set config: hidden_states TYPE_BF16")
    types = json.loads(c.parameters["datatypes"].string_value)
    check("hidden_states" not in types and "output" not in types and
          types.get("router_logits") == ["FP32", "FP16", "BF16"],
          f"bf16 set datatypes: one activation dtype, router_logits any float ({types})")
    # what is not advertised is rejected: metadata and behaviour agree
    x = bf16(np.ones((2, HIDDEN), np.float32))
    logits = np.zeros((2, EXPERTS), np.float32)
    req = make_req("bf16set", [("hidden_states", "BF16", [2, HIDDEN], x.tobytes()),
                               ("router_logits", "FP32", [2, EXPERTS], logits.tobytes()),
                               ("correction_bias", "FP32", [EXPERTS], np.zeros(EXPERTS, np.float32).tobytes())])
    code, _ = code_of(lambda: infer_pb(ch, req))
    check(code == grpc.StatusCode.INVALID_ARGUMENT, f"bf16 set rejects correction_bias ({code})")
    req = make_req("bf16set", [("hidden_states", "FP16", [2, HIDDEN], x.tobytes()),
                               ("router_logits", "FP32", [2, EXPERTS], logits.tobytes())])
    code, _ = code_of(lambda: infer_pb(ch, req))
    check(code == grpc.StatusCode.INVALID_ARGUMENT, f"bf16 set rejects FP16 ({code})")


def stats_of(cli, model):
    s = cli.get_inference_statistics(model).model_stats[0]
    return s, s.inference_stats


def check_counts(cli, model, n, what):
    s, st = stats_of(cli, model)
    counts = [st.success.count, st.compute_input.count, st.compute_infer.count, st.compute_output.count]
    check(counts == [n] * 4, f"{what}: success == compute_input == compute_infer == compute_output == {n} ({counts})")
    check(st.compute_input.ns > 0 and st.compute_output.ns > 0 and st.compute_infer.ns > 0,
          f"{what}: compute_input, compute_infer, compute_output ns > 0")
    check(st.queue.count == n, f"{what}: queue count {st.queue.count}")
    for b in s.batch_stats:
        check(b.compute_input.count == b.compute_infer.count == b.compute_output.count,
              f"{what}: batch size {b.batch_size} counts agree")
    return s, st


def test_statistics(cli, ch):
    n = 5
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    for _ in range(n):
        inp = tc.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        cli.infer("quant.per_tensor", [inp])
    # a failure counts as one, not as computed
    bad = tc.InferInput("x", [4, 64], "INT32")
    bad.set_data_from_numpy(np.zeros((4, 64), np.int32))
    code, _ = code_of(lambda: cli.infer("quant.per_tensor", [bad]))
    check(code == grpc.StatusCode.INVALID_ARGUMENT, f"int32 x rejected ({code})")
    _, st = check_counts(cli, "quant.per_tensor", n, "quant.per_tensor, one at a time")
    check(st.fail.count == 1, f"quant.per_tensor fail count 1 ({st.fail.count})")
    # concurrent requests to a set are merged (delay 3 ms): each still counted once
    rng = np.random.default_rng(2)
    reqs = [make_req("bf16set", [
        ("hidden_states", "BF16", [3, HIDDEN], bf16(rng.standard_normal((3, HIDDEN))).tobytes()),
        ("router_logits", "FP32", [3, EXPERTS], rng.standard_normal((3, EXPERTS)).astype(np.float32).tobytes())])
        for _ in range(2 * n)]
    with cf.ThreadPoolExecutor(len(reqs)) as pool:
        list(pool.map(lambda r: infer_pb(ch, r), reqs))
    s, _ = check_counts(cli, "bf16set", 2 * n, "bf16 set, concurrent")
    # Triton counts inferences and batch sizes along the batch axis: 3 rows each
    check(s.inference_count == 3 * 2 * n, f"bf16 set inference_count = rows ({s.inference_count} != {6 * n})")
    sizes = {b.batch_size: b.compute_infer.count for b in s.batch_stats}
    check(sum(k * v for k, v in sizes.items()) == 3 * 2 * n and all(k % 3 == 0 for k in sizes),
          f"bf16 set batch_stats by rows executed, multiples of 3 summing to {6 * n} ({sizes})")
    check(s.execution_count == sum(sizes.values()) < 2 * n,
          f"bf16 set executions {s.execution_count}: merged, one per batch_stats count")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        repo = os.path.join(tmp, "repo")
        mkset(f"{repo}/bf16set", "bf16")
        mkset(f"{repo}/fp16set", "fp16")

        def body(cli, ch):
            test_quant_metadata(cli)
            test_quant_config(cli)
            test_set_metadata(cli, ch)
            test_statistics(cli, ch)

        ts.serve(tmp, ["--model-repository", repo, "--max-batch-tokens", str(MAX_BATCH), "--max-queue-delay-us",
                       str(DELAY_US), "--max-queue-size", str(QUEUE)], body)

        def rounded(cli, ch):
            # the batcher waits in whole milliseconds (libuv's timer): the config says what it waits
            db = cli.get_model_config("quant.mx").config.dynamic_batching
            check(db.max_queue_delay_microseconds == 3000,
                  f"--max-queue-delay-us 2001: dynamic_batching says the 3000 us waited ({db.max_queue_delay_microseconds})")

        ts.serve(tmp, ["--max-queue-delay-us", "2001"], rounded)
    exit_with_summary()


if __name__ == "__main__":
    main()
