#!/bin/bash
# H200 calls of a lease, one part per call (each under the device's 10-minute limit), JSON under $OUT:
#   MINISGL_GIT_COMMIT=<sha> MINISGL_GIT_DIRTY=0 bash scripts/h200_lease.sh PART
#   carry: part minisgl .baseline (decode-step A/B), .sglang-whl/a, .sglang-kit; part sglang .sglang-whl/b,
#   .sglang-kit (SGLang's wheels, 25 MB each, in two calls: the tree takes 37 of the 64 MiB a call carries).
#   Call part sglang right after part minisgl: a machine idle for 30 s is released, and a fresh one lacks the
#   wheels of .sglang-whl/a (then unpack them first: `bash scripts/sglang_env.sh .sglang-whl/a --`).
# Parts, in priority order:
#   minisgl  the decode GEMV tuned against cuBLAS when minisgl/kernels/gemv_tuned/ has no table for the card; both
#            decode split merges checked; Qwen3.5's W2/W1/W3 and W2 with the GEMV off; Qwen3-0.6B's W1, W1
#            top-k/top-p, W2 and W2 with the GEMV off; the batch-1 decode step now, on a less full card, and at
#            0d384c4 (.baseline); SGLang's wheels of .sglang-whl/a unpacked for the next part
#   sglang   SGLang 0.5.16 on the same card: Qwen3-0.6B (W1, W1 top-k/top-p, W2, W3, sweep), Qwen3.5-0.8B
#   rest     W2 0.6B/3.5, Qwen3-8B W2 with the GEMV on/off, the batch-mix sweep, the decode merge A/B, Qwen3.5
#            greedy with graphs on/off (fp32)
#   decode   the batch-1 step (issue 10): the decode K/V store fused into attention checked and A/B'd on W2, 8B W2,
#            the step's timeline for 0.6B (default, and with a tiny KV pool) and 8B, the bare graph-gap test
#   early    (run12, call 1; carry .sglang-whl/a .sglang-kit) how many GEMV weight tiles to load before the PDL
#            wait and cuBLAS's batch-1 projections on the GEMV (0.6B W2 and 8B W2), W1 / W1 top-k/top-p with PDL on
#            and off, where the long-prompt sweep mix's time goes; SGLang's wheels of .sglang-whl/a unpacked
#   final    (call 2, right after; carry .sglang-whl/b .sglang-kit) SGLang on Qwen3-0.6B (W1, W1 top-k/top-p, W2,
#            W3, sweep), then minisgl's standard set and sweep with the early-tile count that won in part early
#   mixed    the mixed-step split: the Triton backend checked on the GPU, then one process per arm (W1s, sweep);
#            with .sglang-whl/a and .sglang-kit carried, a first call before final and final8 (as part early)
#   final8   (call 3, right after; carry .sglang-kit again: a call without it in carry lost the kit's stubs, and
#            run12's SGLang import failed on IPython) minisgl and SGLang on Qwen3-8B: W1, W1 top-k/top-p, W2;
#            first the GEMV's wide-tile tune and W2 A/B for 8B (wide_ab8), whose winning table minisgl's 8B runs
#            take (as part final takes part mixed's wide_ab06 winner for 0.6B)
#   verify   after run11's default changes (fused K/V store, PDL): W1 / W1 top-k/top-p with PDL on and off, the
#            Qwen3-0.6B standard set and the batch-mix sweep, Qwen3-8B W1 / W1 top-k/top-p / W2
# The device returns at most 8 files a call (run10 lost two JSON files to that): JSON under $OUT, logs under
# /tmp/lease-logs, packed into $OUT/logs.tgz when the part ends; each part writes at most 7 JSON files.
set -u
mkdir -p /tmp/lease-logs
trap 'tar czf "$OUT/logs.tgz" -C /tmp lease-logs 2>/dev/null' EXIT
# each JSON is also kept in /tmp/lease-logs, where a later call on the same warm machine can read it
run() { local file=$1; shift; python3 scripts/h200_run.py --out "$OUT" --file "$file.json" --sections "$@" \
          > "/tmp/lease-logs/$file.log" 2>&1; tail -n 3 "/tmp/lease-logs/$file.log" | cut -c1-300
        cp "$OUT/$file.json" /tmp/lease-logs/ 2>/dev/null; }
sglang() { local model=$1 tag=$2 sections=$3
           bash scripts/sglang_env.sh .sglang-whl/a .sglang-whl/b -- scripts/sglang_bench.py --model "$model" \
             --sections "$sections" --out "$OUT/sglang_$tag.json" > "/tmp/lease-logs/sglang_$tag.log" 2>&1
           tail -n 2 "/tmp/lease-logs/sglang_$tag.log" | cut -c1-300; }
# the early-tile count (kernels/gemv.py PDL_EARLY_TILES) with the lowest mean W2 TPOT in part early's A/B (nothing
# if that did not run on this machine: the default stands); the engines of parts final/final8 run with it
pick_early() { python3 - <<'PY'
import collections, json, statistics
try:
    runs = json.load(open("/tmp/lease-logs/early.json"))["sections"]["early_ab06"]["result"]
except (OSError, KeyError):
    runs = {}
tpot = collections.defaultdict(list)
for label, r in runs.items():
    if "all_gemv" not in label and "w2" in r:
        tpot[int(label[len("early"):].split("_")[0])].append(r["w2"]["tpot_ms_median"])
print(min(tpot, key=lambda n: statistics.mean(tpot[n])) if tpot else "")
PY
}
# the GEMV table (wide_gemv_ab in scripts/h200_run.py: default / wide / all_gemv) with the lowest mean W2 TPOT in
# section $2 of /tmp/lease-logs/$1.json, as a path for MINISGL_GEMV_CONFIGS; nothing when the repo's table won or
# the section did not run on this machine
pick_gemv() { python3 - "$1" "$2" <<'PY'
import collections, json, statistics, sys
file, section = sys.argv[1:]
try:
    result = json.load(open(f"/tmp/lease-logs/{file}.json"))["sections"][section]["result"]
except (OSError, KeyError):
    result = {}
tpot = collections.defaultdict(list)
for label, r in result.get("runs", {}).items():
    if "w2" in r:
        tpot[label.rsplit("_", 1)[0]].append(r["w2"]["tpot_ms_median"])
rounds = max(map(len, tpot.values()), default=0)
complete = {label: statistics.mean(t) for label, t in tpot.items() if len(t) == rounds}
best = min(complete, key=complete.get) if "default" in complete else "default"
model = {"wide_ab06": "qwen3-0.6b", "wide_ab8": "qwen3-8b"}[section]
print("" if best == "default" else f"/tmp/lease-logs/gemv_tables/{model}_{best}.json")
PY
}
timeline() { local label=$1; shift; python3 scripts/decode_timeline.py --out "$OUT" --label "$label" "$@" 2>&1 \
               | tail -n 1 | cut -c1-300; }
case "${1:-minisgl}" in
  minisgl)
    [ -d .sglang-whl/a ] && bash scripts/sglang_env.sh .sglang-whl/a -- >/dev/null 2>&1 &
    if ! ls minisgl/kernels/gemv_tuned/*.json >/dev/null 2>&1; then
      python3 scripts/gpu_gemv_tune.py --out /tmp/lease-logs > /tmp/lease-logs/gemv_tune.log 2>&1
      tail -n 2 /tmp/lease-logs/gemv_tune.log; cp /tmp/lease-logs/gpu_gemv_tune.json "$OUT/" 2>/dev/null
      [ -f /tmp/lease-logs/gemv_configs.json ] && export MINISGL_GEMV_CONFIGS=/tmp/lease-logs/gemv_configs.json
    fi
    # both decode split merges against the reference (the fused one is an A/B, off by default since run10)
    run merge_check decode_merge
    run lease qwen35,gemv_ab35,sample06,gemv_ab06
    timeline new
    # the wider kernel-to-kernel gap (DECODE_STEP.md): not the number of graphs (run10); a less full card?
    timeline new_smallkv --set kv_memory_fraction=0.3
    [ -d .baseline/minisgl ] && MINISGL_ROOT=$PWD/.baseline timeline base0d384c4
    wait ;;
  sglang)
    # the wheels arrive in two calls (64 MiB a call): .sglang-whl/a with part minisgl, .sglang-whl/b with this one
    S="bash scripts/sglang_env.sh .sglang-whl/a .sglang-whl/b --"
    $S scripts/sglang_bench.py --model qwen3-0.6b --sections w1,w1_topkp,w2,w3,sweep --out "$OUT/sglang_06.json" \
      > "$OUT/sglang_06.log" 2>&1; tail -n 2 "$OUT/sglang_06.log" | cut -c1-300
    $S scripts/sglang_bench.py --model qwen3.5-0.8b --sections w1,w2,w3 --out "$OUT/sglang_35.json" \
      > "$OUT/sglang_35.log" 2>&1; tail -n 2 "$OUT/sglang_35.log" | cut -c1-300 ;;
  rest)
    run run10_w2 w2_06,w2_35
    run run10_8b gemv_ab8
    run run10_sweep sweep06
    run run10_merge_ab merge_ab06
    QWEN35_CHECK_DTYPES=float32 run run10_check qwen35_check ;;
  decode)
    run store_check decode_store
    run store_ab store_ab06,w2_8b
    timeline new
    # a fuller card spaced out a bare graph's kernels (run11 graph_gap.json: 0.83 -> 1.00 us from 25% full)
    timeline new_tinykv --set kv_memory_fraction=0.02
    timeline 8b --model assets/configs/qwen3-8b
    python3 scripts/gpu_graph_gap.py --out "$OUT" --fills 0,0.01,0.03,0.1,0.25 > /tmp/lease-logs/graph_gap.log 2>&1
    tail -n 1 /tmp/lease-logs/graph_gap.log | cut -c1-300 ;;
  early)
    [ -d .sglang-whl/a ] && bash scripts/sglang_env.sh .sglang-whl/a -- >/dev/null 2>&1 &
    run early early_ab06,pdl_w1_06,sweep_phases06,early_ab8
    wait ;;
  final)
    sglang qwen3-0.6b 06 w1,w1_topkp,w2,w3,sweep
    early=$(pick_early); [ -n "$early" ] && export MINISGL_GEMV_PDL_EARLY_TILES=$early; echo "early tiles: ${early:-default}"
    table=$(pick_gemv wide06 wide_ab06); [ -n "$table" ] && export MINISGL_GEMV_CONFIGS=$table
    echo "GEMV table: ${table:-repo default}"
    run final06 sample06,w3_06,sweep06 ;;
  final8)
    early=$(pick_early); [ -n "$early" ] && export MINISGL_GEMV_PDL_EARLY_TILES=$early; echo "early tiles: ${early:-default}"
    # the GEMV tuned again with wide K tiles for 8B's shapes, A/B'd on W2; the winning table for the 8B runs
    run wide8 wide_ab8
    table=$(pick_gemv wide8 wide_ab8); [ -n "$table" ] && export MINISGL_GEMV_CONFIGS=$table
    echo "GEMV table: ${table:-repo default}"
    run final8 sample8
    sglang qwen3-8b 8 w1,w1_topkp,w2 ;;
  wide8)
    # (run13) part final8's wide_ab8 and minisgl's 8B runs with the winning table, without SGLang
    run wide8 wide_ab8
    table=$(pick_gemv wide8 wide_ab8); [ -n "$table" ] && export MINISGL_GEMV_CONFIGS=$table
    echo "GEMV table: ${table:-repo default}"
    run final8_wide sample8 ;;
  mixed)
    # the mixed-step split A/B, one process per arm (run12's in-process split_ab06 at 6caa2fa did not start its
    # arms on equal memory); the backend checked against the torch backend on the GPU first. Carrying
    # .sglang-whl/a and .sglang-kit makes it a first call that parts final and final8 can follow on the same machine.
    [ -d .sglang-whl/a ] && bash scripts/sglang_env.sh .sglang-whl/a -- >/dev/null 2>&1 &
    run mixed_check kernels_backends
    run mixed_split mixed06
    MINISGL_MIXED_DECODE_SPLIT=0 run mixed_one_launch mixed06_long
    # the GEMV tuned again with wide K tiles for 0.6B's shapes, A/B'd on W2 (part final takes the winning table)
    run wide06 wide_ab06
    wait ;;
  verify)
    run pdl_w1 pdl_w1_06
    run verify06 sample06,sweep06
    run verify8 sample8 ;;
esac
