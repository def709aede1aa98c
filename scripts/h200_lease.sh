#!/bin/bash
# This session's H200 calls, one part per call (each under the device's 10-minute limit), JSON under $OUT:
#   MINISGL_GIT_COMMIT=<sha> MINISGL_GIT_DIRTY=0 bash scripts/h200_lease.sh PART
#   carry: part minisgl .baseline (decode-step A/B), .sglang-whl/a, .sglang-kit; part sglang .sglang-whl/b,
#   .sglang-kit (SGLang's wheels, 25 MB each, in two calls on the warm machine)
# Parts, in priority order:
#   minisgl  the decode GEMV checked and tuned against cuBLAS (its table then used by every engine below, unless
#            minisgl/kernels/gemv_tuned/ already has one); Qwen3.5's W2/W1/W3 and W2 with the GEMV off;
#            Qwen3-0.6B's W1, W1 top-k/top-p, W2 and W2 with the GEMV off; the batch-1 decode step now, with
#            fewer graphs, and at 0d384c4 (.baseline); SGLang's wheels unpacked for the next part
#   sglang   SGLang 0.5.16 on the same card: Qwen3-0.6B (W1, W1 top-k/top-p, W2, W3, sweep), Qwen3.5-0.8B
#   rest     Qwen3-8B W2 with the GEMV on/off, Qwen3.5's decode steps profiled, Qwen3.5 greedy with graphs on/off (fp32), the batch-mix sweep
set -u
run() { local file=$1; shift; python3 scripts/h200_run.py --out "$OUT" --file "$file.json" --sections "$@" \
          > "$OUT/$file.log" 2>&1; tail -n 3 "$OUT/$file.log" | cut -c1-300; }
timeline() { local label=$1; shift; python3 scripts/decode_timeline.py --out "$OUT" --label "$label" "$@" 2>&1 \
               | tail -n 1 | cut -c1-300; }
case "${1:-minisgl}" in
  minisgl)
    [ -d .sglang-whl/a ] && bash scripts/sglang_env.sh .sglang-whl/a -- >/dev/null 2>&1 &
    if ! ls minisgl/kernels/gemv_tuned/*.json >/dev/null 2>&1; then
      python3 scripts/gpu_gemv_tune.py --out "$OUT" > "$OUT/gemv_tune.log" 2>&1; tail -n 2 "$OUT/gemv_tune.log"
      [ -f "$OUT/gemv_configs.json" ] && export MINISGL_GEMV_CONFIGS=$OUT/gemv_configs.json
    fi
    # both decode split merges against the reference (the fused one is an A/B, off by default since run10)
    run run10_merge decode_merge
    run run10_35 qwen35,gemv_ab35
    run run10_06 sample06,gemv_ab06
    timeline new
    timeline new_fewgraphs --set prefill_graph_max_tokens=0 --set cuda_graph_max_bs=8
    [ -d .baseline/minisgl ] && MINISGL_ROOT=$PWD/.baseline timeline base0d384c4
    wait ;;
  sglang)
    # the wheels arrive in two calls (64 MiB a call): .sglang-whl/a with part minisgl, .sglang-whl/b with this one
    S="bash scripts/sglang_env.sh .sglang-whl/a .sglang-whl/b --"
    $S scripts/sglang_bench.py --model qwen3-0.6b --sections w1,w1_topkp,w2,w3,sweep --out "$OUT/sglang_06.json" \
      > "$OUT/sglang_06.log" 2>&1; tail -n 2 "$OUT/sglang_06.log" | cut -c1-300
    $S scripts/sglang_bench.py --model qwen3.5-0.8b --sections w1,w2,w3 --out "$OUT/sglang_35.json" \
      > "$OUT/sglang_35.log" 2>&1; tail -n 2 "$OUT/sglang_35.log" | cut -c1-300 ;;
  rest2)  # after the GEMV picks per row count (minisgl/kernels/gemv_tuned/NVIDIA_H200.json): JSON only under $OUT
    r2() { local f=$1; shift; python3 scripts/h200_run.py --out "$OUT" --file "$f.json" --sections "$@" \
             > "/tmp/$f.log" 2>&1; tail -n 2 "/tmp/$f.log" | cut -c1-300; }
    r2 run10_w2 w2_06,w2_35
    r2 run10_8b gemv_ab8
    r2 run10_sweep sweep06
    r2 run10_merge_ab merge_ab06
    QWEN35_CHECK_DTYPES=float32 r2 run10_check qwen35_check ;;
  rest)
    run run10_8b gemv_ab8,merge_ab06
    run run10_profile35 profile35
    QWEN35_CHECK_DTYPES=float32 run run10_check qwen35_check
    run run10_sweep sweep06 ;;
esac
