#!/usr/bin/env bash
# Issue 11, for the next session's first device call: what the ninth session could not run once its device time
# was spent. (1) The GPU suites that exercise decode projections of 2-16 rows, now that model/skinny.py takes
# Qwen3-shaped ones (every small test model's projections fall inside its rule); (2) the few-rows kernel on one
# projection at a time against cuBLAS (skinny-only-*, skinny-off) on Llama-3.2-1B, and the rule against cuBLAS on
# Qwen3-0.6B at batch 8, which was not measured. Logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
echo "== gpu tests"
timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_skinny.py tests/test_gemv.py tests/test_gpu_e2e.py \
    tests/test_decode_replay.py tests/test_compile_watch.py tests/test_graphs_gpu.py tests/test_decode_batch.py \
    tests/test_pdl.py tests/test_fused_kernels.py 2>&1 | tee "$OUT/tests.log" | tail -8
for SHAPE in llama-3.2-1b qwen3-0.6b; do
    CK=/tmp/ck-$SHAPE
    [ -d "$CK" ] || timeout 80 python3 -m ostinato.cli make-checkpoint "$CK" --shape $SHAPE --dtype bfloat16 2>&1 | tail -1
    if [ $SHAPE = llama-3.2-1b ]; then B="4 16"; ONLY="skinny-off skinny-only-"; else B="8"; ONLY="skinny-off"; fi
    echo "== $SHAPE"
    (cd scripts && PYTHONPATH=../src timeout 120 python3 gpu_variants.py "$CK" --batches $B --context 512 \
        --max-model-len 2048 --rounds 5 --replays 20 --only $ONLY 2>&1 | tee "$OUT/skinny-$SHAPE.log" \
        | grep -E "^bs|rror|Trace")
done
