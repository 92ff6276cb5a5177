#!/usr/bin/env bash
# Issue 11, round 3 on the H200 (from the lead's checkout root, this tree in .h11/): GPU tests of the
# changed model path, then bench (with plot), bench kernels and bench peers on random checkpoints.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cd .h11
export PYTHONPATH=src
echo "== gpu tests"
timeout 110 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_gemv.py tests/test_gpu_e2e.py \
  tests/test_fused_kernels.py 2>&1 | tail -4
for SHAPE in qwen3-0.6b llama-3.2-1b; do
  python3 -m ostinato.cli make-checkpoint /tmp/ck-$SHAPE --shape $SHAPE --dtype bfloat16 2>&1 | tail -1
done
G="--max-model-len 2048 --gpu-memory-utilization 0.5"
echo "== bench qwen3-0.6b"
timeout 90 python3 -m ostinato.cli --log-level WARNING bench /tmp/ck-qwen3-0.6b $G --cuda-graph-sizes "1 16 64" \
  --batch-sizes "1 16 64" --context 512 --iters 50 --no-hf --output-json $OUT/bench_qwen.json --plot $OUT/bench_qwen.png 2>&1 | grep -E "^bs|rror|ail"
echo "== bench kernels qwen3-0.6b"
timeout 90 python3 -m ostinato.cli --log-level WARNING bench kernels /tmp/ck-qwen3-0.6b $G --cuda-graph-sizes "1 64" \
  --batch-sizes "1 64" --context 512 --output-json $OUT/kernels_qwen.json --plot $OUT/kernels_qwen.png 2>&1 | grep -v Warning
echo "== bench peers llama-3.2-1b"
timeout 120 python3 -m ostinato.cli --log-level WARNING bench peers /tmp/ck-llama-3.2-1b $G --cuda-graph-sizes "1" \
  --context 512 --iters 30 --output-json $OUT/peers_llama1b.json --plot $OUT/peers_llama1b.png 2>&1 | grep -vi warn | tail -6
echo "== bench llama-3.2-1b"
timeout 90 python3 -m ostinato.cli --log-level WARNING bench /tmp/ck-llama-3.2-1b $G --cuda-graph-sizes "1 16 64" \
  --batch-sizes "1 16 64" --context 512 --iters 50 --no-hf --output-json $OUT/bench_llama1b.json 2>&1 | grep -E "^bs|rror|ail"
