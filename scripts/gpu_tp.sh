#!/usr/bin/env bash
# Tensor parallelism measured in one call on a host of two GPUs:
#   1. tests/test_tp_gpu.py: TP=2 greedy equal to TP=1 (Llama-3.2-1B shape, float32) through
#      piecewise, decode and NGRAM verify graphs; bf16 logits within tolerance; `torchrun
#      --nproc-per-node 2 -m pcgspec generate` equal to the spawned TP=2 engine; the one-shot
#      symmetric-memory all-reduce equal to NCCL (eager, in a CUDA graph, end to end). A hang
#      (NCCL's teardown waiting on a live CUDA graph was one) dumps every thread's stack after
#      --hang-s seconds;
#   2. scripts/bench_tp.py: the Qwen3-8B-shape targets (decode at batch 1 and 32, prefill 2,048,
#      piecewise vs a whole compiled graph, start-up), with cold compile caches, NCCL only and then with the
#      one-shot all-reduce up to 512 KiB;
#   3. scripts/profile_spec_step.py: the EAGLE3 step (untrained head, a chain of 3, speculating
#      at every step) at TP=2 over TP=1, with the one-shot all-reduce (each engine writes and loads
#      a random 8B checkpoint: about 3 minutes an engine).
# The default model's tokenizer must be in PCGSPEC_CACHE_DIR (the tests' prompts use it; its
# weights are not needed). NVLink multicast stays off. Writes tp_gpu_tests.log, bench_tp.log,
# bench_tp_one_shot.log, tp_bench_qwen3-8b-shape_<label>_<date>[_one_shot].json, tp_spec_step.log
# and profile_spec_step_eagle3_tp_qwen3-8b-shape_<label>_<date>.json under --out. Allow about 20
# minutes on two GPUs, so start it in the background and poll:
#
#   (setsid nohup bash scripts/gpu_tp.sh --out /tmp/tp --device-label h100x2 > /tmp/tp.log 2>&1 &)
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=bench/results
LABEL=gpu
HANG_S=150
while [[ $# -gt 0 ]]; do
  case $1 in
    --out) OUT=$2; shift 2 ;;
    --device-label) LABEL=$2; shift 2 ;;
    --hang-s) HANG_S=$2; shift 2 ;;
    *) echo "usage: $0 [--out DIR] [--device-label NAME] [--hang-s SECONDS]" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

timeout $((8 * HANG_S + 300)) python -m pytest -v -p no:cacheprovider \
  -o faulthandler_timeout="$HANG_S" tests/test_tp_gpu.py > "$OUT/tp_gpu_tests.log" 2>&1
echo "tests: exit $?" | tee -a "$OUT/tp_gpu_tests.log"
grep -E "PASSED|FAILED|ERROR|Timeout" "$OUT/tp_gpu_tests.log" || true

caches=$(mktemp -d)
PCGSPEC_CACHE_DIR="$caches/pcgspec" TRITON_CACHE_DIR="$caches/triton" \
  timeout 900 python scripts/bench_tp.py --tp-size 2 --repeats 10 \
  --out "$OUT/tp_bench_qwen3-8b-shape_${LABEL}_$(date +%F).json" > "$OUT/bench_tp.log" 2>&1
echo "bench_tp: exit $?" | tee -a "$OUT/bench_tp.log"
tail -n 20 "$OUT/bench_tp.log"

PCGSPEC_CACHE_DIR="$caches/pcgspec" TRITON_CACHE_DIR="$caches/triton" \
  timeout 900 python scripts/bench_tp.py --tp-size 2 --repeats 10 --symm-mem-max-bytes 524288 \
  --out "$OUT/tp_bench_qwen3-8b-shape_${LABEL}_$(date +%F)_one_shot.json" \
  > "$OUT/bench_tp_one_shot.log" 2>&1
echo "bench_tp one-shot: exit $?" | tee -a "$OUT/bench_tp_one_shot.log"
tail -n 20 "$OUT/bench_tp_one_shot.log"

PCGSPEC_TP_SYMM_MEM_MAX_BYTES=524288 timeout 900 python scripts/profile_spec_step.py --shape qwen3-8b \
  --methods EAGLE3 --batch-sizes 1 --num-steps 3 --tp-sizes 1,2 --repeats 5 --no-plain \
  --out "$OUT/profile_spec_step_eagle3_tp_qwen3-8b-shape_${LABEL}_$(date +%F).json" > "$OUT/tp_spec_step.log" 2>&1
echo "EAGLE3 step at TP=1 and TP=2: exit $?" | tee -a "$OUT/tp_spec_step.log"
grep -E '^\{' "$OUT/tp_spec_step.log" | cut -c1-200 || true
