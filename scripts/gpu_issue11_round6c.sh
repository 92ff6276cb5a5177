#!/usr/bin/env bash
# Issue 11, the third call after gpu_issue11_round6{,b}.sh: the SwiGLU activation folded into the gate_up
# projection (gpu_variants.py fold-glu; kernels/gemv.py's choose_glu_fold, off until this measures it) against
# the default, with no-silu (the activation removed altogether: the most the fold can save), whole decode steps
# in one process on the three public shapes at batches 1, 4, 16. fold-glu's `rel diff` line is its logits
# against the default's. Logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for SHAPE in qwen3-0.6b llama-3.2-1b llama-3.1-8b; do
    CK=/tmp/ck-$SHAPE
    [ -d "$CK" ] || timeout 90 python3 -m ostinato.cli make-checkpoint "$CK" --shape $SHAPE --dtype bfloat16 2>&1 | tail -1
    if [ $SHAPE = llama-3.1-8b ]; then B="1 16"; else B="1 4 16"; fi
    echo "== $SHAPE"
    (cd scripts && PYTHONPATH=../src timeout 150 python3 gpu_variants.py "$CK" --batches $B --context 512 \
        --max-model-len 2048 --rounds 5 --replays 20 --only fold-glu no-silu 2>&1 | tee "$OUT/glu-$SHAPE.log" \
        | grep -E "^bs|rror|Trace")
done
