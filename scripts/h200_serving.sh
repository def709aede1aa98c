#!/bin/bash
# Online serving on the H200 (issue 24), one part per device call, JSON/JSONL under $OUT. The same model folder for
# both servers (Qwen3-0.6B body, the embedded model's 4k tokenizer, dummy bf16 weights: the kit's serving.sh), the
# same client commands. Carry .sglang-whl and .sglang-kit (README of the kit, step 1).
#   bash scripts/h200_serving.sh minisgl LABEL [SERVE FLAGS]  minisgl's server, SGLang's client (bench_serving
#                                                            --backend vllm): 8, 24, 48 req/s and all at once
#   bash scripts/h200_serving.sh ours LABEL [SERVE FLAGS]     minisgl's server, minisgl's client
#                                                            (python -m minisgl.bench.serving), then the same
#                                                            all-at-once requests offline: the server/offline ratio
#   bash scripts/h200_serving.sh sglang                       SGLang's server, SGLang's client, the same loads
# e.g. LABEL=default; LABEL=mixed512 --mixed-prefill-tokens 512 (bounded prefill in decoding steps, the A/B of
# suspect (b)). Loads: 300 requests of 1024 in / 256 out (range 0.5) at 8, 24 and 48 req/s, seed 1; 512 at once,
# 1024 in / 512 out (range 0.25).
set -u
K=.sglang-kit; W=.sglang-whl; M=/tmp/serving-model; PORT=30010; URL=http://127.0.0.1:$PORT
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT" /tmp/serving-logs
[ -f $M/config.json ] || bash $K/serving.sh $W model $M
what=$1; shift
label=${1:-default}; [ $# -gt 0 ] && shift

wait_up() { for _ in $(seq 600); do curl -sf $URL/health >/dev/null && return 0; kill -0 "$1" 2>/dev/null || return 1
            sleep 0.5; done; return 1; }
sglang_client() { local tag=$1
  for load in "rate8 8 300 256 0.5" "rate24 24 300 256 0.5" "rate48 48 300 256 0.5" "burst inf 512 512 0.25"; do
    set -- $load
    bash $K/serving.sh $W bench -- --backend vllm --base-url $URL --model $M --tokenizer $M --dataset-name random-ids \
      --random-input-len 1024 --random-output-len $4 --random-range-ratio $5 --num-prompts $3 --request-rate $2 \
      --seed 1 --output-file "$OUT/${tag}_$1.jsonl" > "/tmp/serving-logs/${tag}_$1.log" 2>&1
    grep -E "Output token throughput|Median (TTFT|TPOT|ITL)|P99 ITL|Successful" "/tmp/serving-logs/${tag}_$1.log" \
      | tr -s ' ' | paste -sd';' | sed "s/^/$tag $1: /"
  done; }
stop() { kill -TERM "$1" 2>/dev/null; for _ in $(seq 120); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.5; done
         kill -KILL -- "-$1" 2>/dev/null; }

case $what in
  minisgl)
    setsid python3 -m minisgl serve --model $M --load-format dummy --port $PORT --log-level warning "$@" \
      > /tmp/serving-logs/minisgl_$label.log 2>&1 & pid=$!
    wait_up $pid || { tail -20 /tmp/serving-logs/minisgl_$label.log; exit 1; }
    sglang_client "minisgl_$label"; stop $pid ;;
  ours)
    python3 -m minisgl.bench.serving --model $M --label "$label" --rates 8,24,48,inf --offline \
      --out "$OUT/ours_$label.json" -- --load-format dummy "$@" 2>&1 | tail -6 ;;
  sglang)
    setsid bash $K/serving.sh $W sglang-server -- --model-path $M --load-format dummy --dtype bfloat16 --attention-backend \
      triton --sampling-backend pytorch --grammar-backend none --host 127.0.0.1 --port $PORT \
      > /tmp/serving-logs/sglang_server.log 2>&1 & pid=$!
    wait_up $pid || { tail -20 /tmp/serving-logs/sglang_server.log; exit 1; }
    sglang_client sglang; stop $pid ;;
  *) echo "usage: h200_serving.sh minisgl|ours LABEL [SERVE FLAGS] | sglang"; exit 2 ;;
esac
