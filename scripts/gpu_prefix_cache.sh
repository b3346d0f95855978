#!/usr/bin/env bash
# The prefix cache measured on a GPU in one call: for SmolLM2-135M-Instruct (the default model;
# PCGSPEC_CACHE_DIR must hold it) and the Llama-3.2-1B shape with random weights (written once,
# with the default model's tokenizer and vocabulary), bf16, two datasets, each one
# bench_serving.py invocation with the radix cache on and off (two server starts):
#   shared-prefix: 64 requests of a 2,000-token system prompt + 32-token question, 32 output
#                  tokens, 16 at a time (targets: TTFT p50 <= 0.2x, requests/s >= 1.5x);
#   multi-turn:    16 chats x 8 turns, 32-word questions, 32 output tokens (target: prefill
#                  tokens computed <= 0.25x).
# Writes prefix_{shared,multi_turn}_{smollm2,llama-3.2-1b-shape}_<label>_<date>.json and the
# servers' logs under --out, then prints every on/off ratio. Estimated 5-7 minutes on an H100:
# 8 server starts of 20-40 s (compile, graph capture, kernel warm-up), about 20 s writing the 1B
# folder, a few seconds per load; --models runs a subset (e.g. one model per call).
#
#   bash scripts/gpu_prefix_cache.sh --out "$OUT" --device-label h100 [--models smollm2]
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=bench/results
LABEL=gpu
DATE=$(date +%F)
RANDOM_DIR=/tmp/pcgspec-random-llama-3.2-1b
MODELS=smollm2,llama-3.2-1b
while [[ $# -gt 0 ]]; do
  case $1 in
    --out) OUT=$2; shift 2 ;;
    --device-label) LABEL=$2; shift 2 ;;
    --random-weights-dir) RANDOM_DIR=$2; shift 2 ;;
    --models) MODELS=$2; shift 2 ;;
    *) echo "usage: $0 [--out DIR] [--device-label NAME] [--models smollm2,llama-3.2-1b]" \
            "[--random-weights-dir DIR]" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

COMMON=(--launch --base-url http://127.0.0.1:30021 --server-args "--dtype bfloat16"
        --warmup 4 --device-label "$LABEL")
SHARED=(--dataset shared-prefix --shared-prefix-len 2000 --question-len 32 --num-prompts 64
        --random-output-len 32 --max-concurrency 16)
MULTI=(--dataset multi-turn --num-chats 16 --num-turns 8 --question-len 32
       --random-output-len 32 --max-concurrency 16)
start=$SECONDS
for model in ${MODELS//,/ }; do
  case $model in
    smollm2) weights=(); tag=smollm2 ;;
    llama-3.2-1b) weights=(--random-weights llama-3.2-1b --random-weights-dir "$RANDOM_DIR")
                  tag=llama-3.2-1b-shape ;;
    *) echo "unknown model $model (smollm2, llama-3.2-1b)" >&2; exit 2 ;;
  esac
  for dataset in shared multi_turn; do
    if [[ $dataset == shared ]]; then load=("${SHARED[@]}"); else load=("${MULTI[@]}"); fi
    name=prefix_${dataset}_${tag}_${LABEL}_${DATE}
    echo "=== $name (at ${SECONDS}s)"
    python scripts/bench_serving.py "${COMMON[@]}" "${weights[@]}" "${load[@]}" \
      --server-log "$OUT/$name.server.log" --out "$OUT/$name.json"
  done
done
echo "=== done in $((SECONDS - start)) s"

python - "$OUT" "$LABEL" "$MODELS" "$DATE" <<'EOF'
import json, sys
from pathlib import Path

out, label, models, date = Path(sys.argv[1]), sys.argv[2], sys.argv[3].split(","), sys.argv[4]
tags = {"smollm2": "smollm2", "llama-3.2-1b": "llama-3.2-1b-shape"}
print(f"{'run':<56}{'metric':<26}{'cache on':>11}{'cache off':>11}{'on/off':>9}")
for model in models:
    for dataset in ("shared", "multi_turn"):
        name = f"prefix_{dataset}_{tags[model]}_{label}_{date}"
        for metric, row in json.loads((out / f"{name}.json").read_text())["cache_comparison"].items():
            on, off, ratio = row["radix_cache"], row["no_radix_cache"], row["ratio"]
            print(f"{name:<56}{metric:<26}{on:>11.2f}{off:>11.2f}"
                  f"{'' if ratio is None else f'{ratio:>8.3f}x'}")
EOF
