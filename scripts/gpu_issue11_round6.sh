#!/usr/bin/env bash
# Issue 11, the first device call after the tenth session (then gpu_issue11_round6b.sh and 6c.sh): (1) the
# few-rows kernel (kernels/skinny.py) alone against cuBLAS on every public projection shape, tiles and split-K
# swept (gpu_skinny.py); (2) the GPU suites that exercise decode projections of 2-16 rows, which did not run
# once the ninth session put Qwen3-shaped ones on that kernel (every small test model's projections fall inside
# its rule), and the SwiGLU fold's kernels (test_glu_fold.py). Logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
echo "== skinny alone"
timeout 200 python3 scripts/gpu_skinny.py --batches 4,16 --json "$OUT/skinny-alone.json" 2>&1 | tee "$OUT/skinny-alone.log"
echo "== gpu tests"
timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_skinny.py tests/test_glu_fold.py tests/test_gemv.py tests/test_gpu_e2e.py \
    tests/test_decode_replay.py tests/test_compile_watch.py tests/test_graphs_gpu.py tests/test_decode_batch.py \
    tests/test_pdl.py tests/test_fused_kernels.py 2>&1 | tee "$OUT/tests.log" | tail -8
