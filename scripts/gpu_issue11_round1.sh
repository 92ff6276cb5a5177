#!/usr/bin/env bash
# Issue 11, round 1 on the H200 (run from the lead's checkout root with this tree in .h11/):
# gpu attention tests, decode attention before (main's src) / after (.h11/src) with a tuning sweep,
# cuBLAS at small M, and `ostinato bench` before/after on two shapes.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROOT=$(pwd)
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
echo "== gpu attention tests (after)"
(cd .h11 && PYTHONPATH=src timeout 240 python3 -m pytest -m gpu tests/test_triton_attention.py -q -x -p no:cacheprovider 2>&1 | tail -5)
echo "== decode attention BEFORE (main)"
PYTHONPATH=$ROOT/src timeout 150 python3 .h11/scripts/gpu_decode_attention.py --json "$OUT/attn_before.json"
echo "== decode attention AFTER (h11) + sweep"
(cd .h11 && PYTHONPATH=src timeout 300 python3 scripts/gpu_decode_attention.py --sweep --json "$OUT/attn_after.json")
echo "== cuBLAS small M"
PYTHONPATH=$ROOT/src timeout 150 python3 .h11/scripts/gpu_small_gemm.py --json "$OUT/gemm.json"
for SHAPE in qwen3-0.6b llama-3.2-1b; do
  PYTHONPATH=$ROOT/src python3 -m ostinato.cli make-checkpoint /tmp/ck-$SHAPE --shape $SHAPE --dtype bfloat16 2>&1 | tail -1
  for SIDE in before after; do
    SRC=$ROOT/src; [ $SIDE = after ] && SRC=$ROOT/.h11/src
    echo "== bench $SHAPE $SIDE"
    PYTHONPATH=$SRC timeout 150 python3 -m ostinato.cli --log-level WARNING bench /tmp/ck-$SHAPE --max-model-len 2048 \
      --gpu-memory-utilization 0.5 --cuda-graph-sizes "1 16 64" --batch-sizes "1 16 64" --context 512 --iters 50 --no-hf \
      --output-json "$OUT/bench_${SHAPE}_$SIDE.json" 2>&1 | grep -E "^bs|model|rror"
  done
done
