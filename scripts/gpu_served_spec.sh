#!/usr/bin/env bash
# Served speculative decoding on a GPU in one call: SmolLM2-135M-Instruct (the default model;
# PCGSPEC_CACHE_DIR must hold it) in bf16 behind `pcgspec serve`, one bench_serving.py sweep over
# three configurations, each its own server (started once, reused across both datasets):
#   plain   no speculation (the reference of every ratio)
#   eagle3  --speculative-algorithm EAGLE3 --speculative-num-steps 3: the head shipped for the
#           default model drafting a chain of 3
#   eagle3-tree  the same head drafting trees: --tree DEPTH,TOPK,N (default 5,4,16) sets
#           --speculative-num-steps, --speculative-eagle-topk, --speculative-num-draft-tokens
#   ngram   --speculative-algorithm NGRAM --speculative-num-steps 4
# chat:       everyday requests at concurrency 1, 4, 16, 64, every configuration;
# repetition: answers that quote or edit a given text, concurrency 1, plain and ngram only;
# at temperature 0 (--temperatures 0,0.7 adds sampling, --temperatures 0.7 runs it alone), up to
# 128 output tokens ending at EOS, a 30 s window after 1 s of warm-up per point (a request lasts
# well under a second here), and first the greedy texts of 8 requests per dataset, compared with
# plain's. Budget on an H100: 14 windows of 31 s (7.2 min), three server starts of 20-40 s
# (compile, graph capture, kernel warm-up; later starts reuse the compile cache), text checks and
# drains ~20 s: about 8.5-9 minutes; the sweep prints the elapsed time before every phase. Two
# temperatures in one call take about 16 minutes: pass one per call instead. --configs runs a
# subset (plain should stay first: the ratios are against the first configuration), and
# --concurrencies a subset of the points (default 1,4,16,64). --rounds N (default 1): the
# configurations take turns N times, each turn its own server, and the ratios are taken within a
# round and summarized by their median: two servers of one configuration on one H200 served
# 20-30% apart, more than most effects measured here.
# Writes served_spec_smollm2_t<temps>_<label>.json, the servers' log and, with matplotlib,
# the ratio plot (.png) under --out.
#
#   bash scripts/gpu_served_spec.sh --out "$OUT" --device-label H100 [--temperatures 0.7]
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=bench/results
LABEL=gpu
TEMPS=0
CONFIGS=plain,eagle3,ngram
DURATION=30
CONCURRENCIES=1,4,16,64
TREE=5,4,16
ROUNDS=1
usage() {
  echo "usage: $0 [--out DIR] [--device-label NAME] [--temperatures 0[,0.7]]" \
       "[--configs plain,eagle3,eagle3-tree,ngram] [--duration SECONDS]" \
       "[--concurrencies 1,4,16,64] [--tree DEPTH,TOPK,N] [--rounds N]" >&2
  exit 2
}
while [[ $# -gt 0 ]]; do
  case $1 in
    --out) OUT=$2; shift 2 ;;
    --device-label) LABEL=$2; shift 2 ;;
    --temperatures) TEMPS=$2; shift 2 ;;
    --configs) CONFIGS=$2; shift 2 ;;
    --duration) DURATION=$2; shift 2 ;;
    --concurrencies) CONCURRENCIES=$2; shift 2 ;;
    --tree) TREE=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    *) usage ;;
  esac
done
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

COMPARE=()
REPEAT=()
for config in ${CONFIGS//,/ }; do
  case $config in
    plain) COMPARE+=("plain=") ; REPEAT+=(plain) ;;
    eagle3) COMPARE+=("eagle3=--speculative-algorithm EAGLE3 --speculative-num-steps 3") ;;
    eagle3-tree) IFS=, read -r depth topk nodes <<<"$TREE"
           tree="--speculative-num-steps $depth --speculative-eagle-topk $topk"
           tree+=" --speculative-num-draft-tokens $nodes"
           COMPARE+=("eagle3-tree=--speculative-algorithm EAGLE3 $tree") ;;
    ngram) COMPARE+=("ngram=--speculative-algorithm NGRAM --speculative-num-steps 4")
           REPEAT+=(ngram) ;;
    *) echo "unknown configuration $config (plain, eagle3, eagle3-tree, ngram)" >&2; exit 2 ;;
  esac
done
DATASETS=(chat)
if [[ ${#REPEAT[@]} -gt 0 ]]; then
  rep=$(IFS=,; echo "${REPEAT[*]}")
  DATASETS+=("repetition:concurrencies=1:configs=$rep")
fi
name=served_spec_smollm2_t${TEMPS//,/-}_${LABEL}
ntemps=$(tr ',' '\n' <<<"$TEMPS" | grep -c .)
npoints=$(tr ',' '\n' <<<"$CONCURRENCIES" | grep -c .)
windows=$(( (${#COMPARE[@]} * npoints + ${#REPEAT[@]}) * ntemps * ROUNDS ))
starts=$(( ${#COMPARE[@]} * ROUNDS ))
echo "=== $name: $starts server starts, $windows windows of ${DURATION} s" \
     "(estimate $(( starts * 30 + windows * (DURATION + 1) + 20 )) s)"

start=$SECONDS
python scripts/bench_serving.py --launch --base-url http://127.0.0.1:30023 \
  --server-args "--dtype bfloat16" --compare "${COMPARE[@]}" --datasets "${DATASETS[@]}" \
  --concurrencies "$CONCURRENCIES" --temperatures "$TEMPS" --duration "$DURATION" \
  --warmup-seconds 1 --text-check 8 --max-tokens 128 --rounds "$ROUNDS" --device-label "$LABEL" \
  --server-log "$OUT/$name.server.log" --out "$OUT/$name.json"
echo "=== sweep done in $((SECONDS - start)) s"
python scripts/plot_serving.py "$OUT/$name.json"
