#!/usr/bin/env bash
# Issue 11, ninth session, on the H200, call 5: the tensor-core linear for 2-16 rows (kernels/skinny.py): its GPU
# tests, then whole decode steps with it in place of cuBLAS for the rows the GEMV leaves (three tilings; since
# the rule takes it, skinny-off is cuBLAS for all of them), one
# process per shape (the two small models, batches 4 and 16), context 512. Logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
START=$SECONDS
echo "== gpu tests"
timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_skinny.py 2>&1 | tee "$OUT/tests.log" | tail -4
for SHAPE in qwen3-0.6b llama-3.2-1b; do
    B=${BATCHES:-4 16}
    CK=/tmp/ck-$SHAPE
    [ -d "$CK" ] || timeout 80 python3 -m ostinato.cli make-checkpoint "$CK" --shape $SHAPE --dtype bfloat16 2>&1 | tail -1
    echo "== $SHAPE ($((SECONDS - START)) s)"
    (cd scripts && PYTHONPATH=../src timeout 70 python3 gpu_variants.py "$CK" --batches $B --context 512 \
        --max-model-len 2048 --rounds 4 --replays 20 --only skinny- 2>&1 \
        | tee "$OUT/skinny-$SHAPE.log" | grep -E "^bs|rror|Trace")
done
