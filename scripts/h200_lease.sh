#!/bin/bash
# One H200 call that checks and times this session's changes, writing JSON under $OUT (see reports/h200/run9/).
#   MINISGL_GIT_COMMIT=<sha> MINISGL_GIT_DIRTY=0 bash scripts/h200_lease.sh        (carry .baseline for the A/B)
# In priority order, each part in its own file, so a call cut short by its time limit keeps what finished:
# the new kernels against their references and Qwen3.5's workloads; Qwen3-0.6B's W1 (temperature, top-k/top-p)
# and W2; the batch-1 decode step now and at 0d384c4 (.baseline); Qwen3.5 greedy with graphs on/off and prefill
# graphs on/off (fp32); the batch-mix sweep.
set -u
run() { local file=$1; shift; python3 scripts/h200_run.py --out "$OUT" --file "$file.json" --sections "$@" \
          > "$OUT/$file.log" 2>&1; tail -n 4 "$OUT/$file.log" | cut -c1-300; }
run run9b kernels_ew,qwen35,sample06
python3 scripts/decode_timeline.py --out "$OUT" --label new 2>&1 | tail -n 1
[ -d .baseline/minisgl ] && MINISGL_ROOT=$PWD/.baseline python3 scripts/decode_timeline.py --out "$OUT" \
  --label base0d384c4 2>&1 | tail -n 1
QWEN35_CHECK_DTYPES=float32 run run9b_check qwen35_check
run run9b_sweep sweep06
