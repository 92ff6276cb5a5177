#!/usr/bin/env bash
# Issue 11, round 2 on the H200 (from the lead's checkout root, this tree in .h11/): GPU tests of the
# changed paths, the Triton small-M linear against cuBLAS, and one engine bench with float32 logits.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cd .h11
export PYTHONPATH=src
echo "== gpu tests"
timeout 150 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_triton_attention.py tests/test_fused_kernels.py \
  tests/test_gpu_e2e.py 2>&1 | tail -8
echo "== gemv vs cuBLAS"
timeout 150 python3 scripts/gpu_gemv.py --batches 1,4 --json "$OUT/gemv.json"
