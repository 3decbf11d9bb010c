"""Integration test: expert parallelism across moed processes (docs/deploy.md
"Expert shards across pods", deploy/k8s/shards).

A layer's expert set is split in two by deploy/tools/split-expert-set.py; two
moed processes each serve one half (config.json's expert_offset), a third the
whole set. The orchestrator's pattern, done here: the same request to both
shards, their outputs added in fp32 and rounded to the activation dtype once.

With top_k = 2 that sum is bit-equal to the whole set: a token's two routed
slots are either both in one shard (that shard's output is the whole set's,
the other's is +0) or one in each (each shard's output is that slot's y_k,
already rounded, and the fp32 sum of two terms is the whole set's sum). With
top_k > 2 a shard holding several slots of a token rounds their partial sum
once more, so the sum is within one rounding per shard (checked against that
bound).

env: MOED, MOE_MKSET."""
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

import ml_dtypes
import numpy as np
import tritonclient.grpc as tc

sys.path.insert(0, os.path.dirname(__file__))
from moed_process import check, exit_with_summary, moed, print_log_tail  # noqa: E402

MKSET = os.environ["MOE_MKSET"]
SPLIT = os.path.join(os.path.dirname(__file__), "..", "..", "deploy", "tools", "split-expert-set.py")


def mkset(path, scheme, top_k, extra=()):
    subprocess.run([MKSET, "--out", path, "--scheme", scheme, "--experts", "8", "--hidden", "128",
                    "--intermediate", "64", "--top-k", str(top_k), *extra], check=True, capture_output=True)


ACT = {"bf16": ("BF16", ml_dtypes.bfloat16), "fp16": ("FP16", np.float16)}


def infer(cli, model, x, act, logits=None, ids=None, weights=None):
    dt, _ = ACT[act]
    ins = [tc.InferInput("hidden_states", list(x.shape), dt)]
    ins[0].set_data_from_numpy(x)
    if logits is not None:
        ins.append(tc.InferInput("router_logits", list(logits.shape), "FP32"))
        ins[-1].set_data_from_numpy(logits)
    else:
        ins.append(tc.InferInput("topk_ids", list(ids.shape), "INT32"))
        ins[-1].set_data_from_numpy(ids)
        ins.append(tc.InferInput("topk_weights", list(weights.shape), "FP32"))
        ins[-1].set_data_from_numpy(weights)
    return cli.infer(model, ins).as_numpy("output")


def shard_sum(parts, act):
    """The orchestrator's sum: fp32, then one rounding to the activation dtype (RNE)."""
    acc = np.zeros(parts[0].shape, np.float32)
    for p in parts:
        acc += p.astype(np.float32)
    return acc.astype(ACT[act][1])


def bits(a):
    return a.view(np.uint16)


def test_sums(sets, rng, whole, s0, s1):
    """Each set through both shards and the whole (clients of the three moeds), the shards' sum checked."""
    T = 96
    for name, (scheme, act, top_k, _) in sets.items():
        x = rng.standard_normal((T, 128)).astype(np.float32).astype(ACT[act][1])
        logits = rng.standard_normal((T, 8)).astype(np.float32)
        ref = infer(whole, name, x, act, logits=logits)
        parts = [infer(c, name, x, act, logits=logits) for c in (s0, s1)]
        got = shard_sum(parts, act)
        # each shard computes only its experts' slots: neither half alone is the whole
        check(not np.array_equal(bits(parts[0]), bits(ref)) and not np.array_equal(bits(parts[1]), bits(ref)),
              f"{name}: each shard's output is partial")
        if top_k == 2:
            check(np.array_equal(bits(got), bits(ref)),
                  f"{name}: shard-0 + shard-1 (router_logits) bit-equal to the whole set")
            # the orchestrator may route itself: the same with topk_ids / topk_weights
            ids = np.argsort(-logits, axis=1, kind="stable")[:, :top_k].astype(np.int32)
            w = rng.uniform(0.1, 1.0, (T, top_k)).astype(np.float32)
            ref2 = infer(whole, name, x, act, ids=ids, weights=w)
            got2 = shard_sum([infer(c, name, x, act, ids=ids, weights=w) for c in (s0, s1)], act)
            check(np.array_equal(bits(got2), bits(ref2)),
                  f"{name}: shard-0 + shard-1 (topk_ids) bit-equal to the whole set")
        else:
            # one extra rounding per shard of its partial sum: |err| <= ulp/2 of each partial
            eps = 2.0 ** -8 if act == "bf16" else 2.0 ** -11
            p32 = [p.astype(np.float32) for p in parts]
            bound = eps * (np.abs(p32[0]) + np.abs(p32[1]) + np.abs(ref.astype(np.float32))) + 1e-30
            err = np.abs(got.astype(np.float32) - ref.astype(np.float32))
            check(bool(np.all(err <= bound)),
                  f"{name}: shard sum within one rounding per shard of the whole set "
                  f"(max err {float(err.max()):.3g}, {int(np.count_nonzero(err))} of {err.size} differ)")


def main():
    rng = np.random.default_rng(12)
    sets = {  # name: (scheme, act, top_k, mkset extras)
        "bf16_top2": ("bf16", "bf16", 2, ["--seed", "1"]),
        "wna16_top2": ("wna16", "bf16", 2, ["--bits", "4", "--group-size", "64", "--zero-points", "--seed", "2"]),
        "fp16_top2": ("fp16", "fp16", 2, ["--activation", "gelu", "--seed", "3"]),
        "bf16_top4": ("bf16", "bf16", 4, ["--seed", "4"]),
    }
    with tempfile.TemporaryDirectory() as tmp:
        full, split = os.path.join(tmp, "full"), os.path.join(tmp, "split")
        for name, (scheme, _, top_k, extra) in sets.items():
            mkset(os.path.join(full, name), scheme, top_k, extra)
            subprocess.run([sys.executable, SPLIT, os.path.join(full, name), split, "--shards", "2"], check=True,
                           capture_output=True)
        for i in range(2):
            for name in sets:
                cfg = json.load(open(os.path.join(split, f"shard-{i}", name, "config.json")))
                check((cfg["num_experts"], cfg["expert_offset"], cfg["global_num_experts"]) == (4, 4 * i, 8),
                      f"shard {i} of {name}: experts 4 from {4 * i} of 8")
        runs = (("full", full), ("s0", os.path.join(split, "shard-0")), ("s1", os.path.join(split, "shard-1")))
        try:
            with contextlib.ExitStack() as servers:
                ports = [servers.enter_context(moed(os.path.join(tmp, "run-" + label), "--rest-port", "-1", "--device",
                                                    "cpu", "--workers", "1", "--model-repository", repo))[1]
                         for label, repo in runs]
                test_sums(sets, rng, *(tc.InferenceServerClient(f"127.0.0.1:{port}") for port in ports))
        finally:
            for label, _ in runs:
                print_log_tail(os.path.join(tmp, "run-" + label))
        shutil.rmtree(split, ignore_errors=True)
    exit_with_summary()


if __name__ == "__main__":
    main()
