#!/usr/bin/env bash
# Where a GPU device worker's time goes per batch, in one short run (issue
# 11's service overhead): tests/gpu/moed_load.sh on the Qwen3-30B-A3B int4
# set only, T = 1 per request at concurrency 1 and 64, one moed at
# --max-queue-delay-us 0, decode only (no in-process bench, no large
# activations), short windows. LOGDIR/load.md holds requests/s and the
# table "Device worker phases per batch" (us per execution in gather,
# prepare, copy_in, launch, copy_out, wait, answer, answer_async);
# LOGDIR/raw/ the /metrics scrapes before and after each level.
# MOED_ANSWER_THREAD=0 in the environment: moed answers on the worker (the
# A/B of the answer thread; docs/server.md "Metrics"); MOED_HOLD_BATCH=0:
# the worker waits for each merged batch before it takes the next (the A/B
# of holding a batch while the next is launched).
#   tests/gpu/worker_phases.sh BINDIR LOGDIR
# BINDIR as for moed_load.sh (tests/gpu/pack.sh's output); MOE_LOAD_DEVICE=cpu
# is the dry run without a GPU (small layers). Other MOE_LOAD_* settings
# given in the environment win.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export MOE_LOAD_SETS=${MOE_LOAD_SETS:-qwen3_int4} MOE_LOAD_LEVELS=${MOE_LOAD_LEVELS:-1 64}
export MOE_LOAD_DELAYS=${MOE_LOAD_DELAYS:-0} MOE_LOAD_QUICK=1
export MOE_LOAD_WARMUP=${MOE_LOAD_WARMUP:-0.3} MOE_LOAD_WINDOW_MS=${MOE_LOAD_WINDOW_MS:-700}
export MOE_LOAD_MAX_WINDOWS=${MOE_LOAD_MAX_WINDOWS:-3}
exec "$here/moed_load.sh" "$@"
