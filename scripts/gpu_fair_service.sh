#!/usr/bin/env bash
# Fair service on a GPU in one call, bf16 behind `pcgspec serve`:
#   mixed_*      16 short chat streams in a closed loop, alone and then beside 8,000-token
#                prompts arriving one per second (bench_serving.py --dataset mixed): the short
#                streams' ITL p50/p99/max with and without the long prompts; on the default
#                model (SmolLM2-135M-Instruct, PCGSPEC_CACHE_DIR must hold it) and on random
#                weights of the Llama-3.2-1B shape;
#   vs_engine_*  1,024 built-in prompts, 16 at a time (about 6 s of load), served and through
#                LLM.generate with the same flags (--compare-engine): served throughput / the
#                engine's own.
# About 5 minutes on an H200 (three server starts, two mixed runs of 2 x 20 s, one engine run).
# --models smollm2 (or llama-3.2-1b-shape) runs the mixed point of one model only; --models ''
# runs the served-vs-engine point alone.
# Writes <what>_<label>_<date>.json and the servers' logs under --out.
#
#   bash scripts/gpu_fair_service.sh --out "$OUT" --device-label H200 [--models smollm2]
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=bench/results
LABEL=gpu
MODELS=smollm2,llama-3.2-1b-shape
while [[ $# -gt 0 ]]; do
  case $1 in
    --out) OUT=$2; shift 2 ;;
    --device-label) LABEL=$2; shift 2 ;;
    --models) MODELS=$2; shift 2 ;;
    *) echo "usage: $0 [--out DIR] [--device-label NAME] [--models LIST]" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
DAY=$(date -u +%F)
label=$(tr '[:upper:]' '[:lower:]' <<<"$LABEL")
bench=(python scripts/bench_serving.py --launch --server-args "--dtype bfloat16"
       --device-label "$LABEL")

start=$SECONDS
for model in ${MODELS//,/ }; do
  weights=()
  [[ $model == smollm2 ]] || weights=(--random-weights llama-3.2-1b)
  echo "=== mixed, $model ($((SECONDS - start)) s)"
  "${bench[@]}" "${weights[@]}" --dataset mixed --max-concurrency 16 --max-tokens 128 \
    --long-prompt-tokens 8000 --long-rate 1 --mixed-seconds 20 \
    --server-log "$OUT/mixed_${model}_${label}_$DAY.server.log" \
    --out "$OUT/mixed_long_prompts_${model}_${label}_$DAY.json"
done
echo "=== served vs engine ($((SECONDS - start)) s)"
"${bench[@]}" --random-weights smollm2-135m --dataset builtin --num-prompts 1024 \
  --max-concurrency 16 --random-output-len 64 --warmup 16 --compare-engine \
  --out "$OUT/serving_vs_engine_smollm2-shape_${label}_${DAY}_c16.json"
echo "=== done in $((SECONDS - start)) s"
