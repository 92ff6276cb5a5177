#!/usr/bin/env bash
# Issue 11, round 2 on the H200 (from the lead's checkout root, this tree in .h11/): GPU tests of the
# changed paths, the Triton small-M linear against cuBLAS, and one engine bench with float32 logits.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cd .h11
export PYTHONPATH=src
echo "== gpu tests"
timeout 240 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_triton_attention.py tests/test_graphs_gpu.py \
  tests/test_fused_kernels.py tests/test_sampler.py tests/test_gpu_e2e.py tests/test_graph_path_engine.py 2>&1 | tail -8
echo "== gemv vs cuBLAS"
timeout 200 python3 scripts/gpu_gemv.py --batches 1,2,4 --json "$OUT/gemv.json"
echo "== bench qwen3-0.6b, float32 logits"
python3 -m ostinato.cli make-checkpoint /tmp/ck-qwen3-0.6b --shape qwen3-0.6b --dtype bfloat16 2>&1 | tail -1
timeout 120 python3 -m ostinato.cli --log-level WARNING bench /tmp/ck-qwen3-0.6b --max-model-len 2048 \
  --gpu-memory-utilization 0.5 --cuda-graph-sizes "1 16 64" --batch-sizes "1 16 64" --context 512 --iters 50 --no-hf \
  --output-json "$OUT/bench_qwen_fp32logits.json" 2>&1 | grep -E "^bs|model|rror|ail"
