#!/usr/bin/env bash
# Issue 11, helper hB's increment on the H200, from the repo root: the GPU tests of the fused RoPE + KV
# write and the single-launch decode, decode attention alone (single launch vs split + reduce kernel), then
# the qwen3-0.6b step (bench, bench kernels). Logs and JSON go to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
echo "== gpu tests"
timeout 240 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_triton_attention.py \
  tests/test_fused_kernels.py 2>&1 | tail -5
echo "== decode attention alone (us per layer; default = single launch), and with the q/k-norm + RoPE + KV write"
timeout 200 python3 scripts/gpu_decode_attention.py --shapes qwen3-0.6b,llama-3.2-1b --compare-merge --rope \
  --cases 1x512,4x512,16x512,1x4096,1x32768 --json $OUT/decode_attention.json 2>&1 | grep -v -i warn
python3 -m ostinato.cli make-checkpoint /tmp/ck-qwen3-0.6b --shape qwen3-0.6b --dtype bfloat16 2>&1 | tail -1
G="--max-model-len 1024 --gpu-memory-utilization 0.5"
echo "== bench qwen3-0.6b"
timeout 120 python3 -m ostinato.cli --log-level WARNING bench /tmp/ck-qwen3-0.6b $G --cuda-graph-sizes "1 16 32 64" \
  --batch-sizes "1 16 32 64" --context 512 --no-hf --output-json $OUT/bench_qwen.json 2>&1 | grep -E "^bs|^model|rror|ail"
echo "== bench kernels qwen3-0.6b"
timeout 120 python3 -m ostinato.cli --log-level WARNING bench kernels /tmp/ck-qwen3-0.6b $G --cuda-graph-sizes "1 64" \
  --batch-sizes "1 64" --context 512 --output-json $OUT/kernels_qwen.json --plot $OUT/kernels_qwen.png 2>&1 | grep -v Warning
