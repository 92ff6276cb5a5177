#!/usr/bin/env bash
# Issue 11, the second device call after gpu_issue11_round6.sh: whole decode steps in one process (gpu_variants.py).
# Llama-3.2-1B: the few-rows kernel on one projection at a time against cuBLAS, whole K and split in 4 slices
# (skinny-k4-*); Qwen3-0.6B: the rule against cuBLAS at batches 4, 8, 16 and each projection's in-step
# bandwidth with the rule on. Logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for SHAPE in llama-3.2-1b qwen3-0.6b; do
    CK=/tmp/ck-$SHAPE
    [ -d "$CK" ] || timeout 80 python3 -m ostinato.cli make-checkpoint "$CK" --shape $SHAPE --dtype bfloat16 2>&1 | tail -1
    if [ $SHAPE = llama-3.2-1b ]; then B="4 16"; ONLY="skinny-off skinny-only- skinny-k4-"; T=250
    else B="4 8 16"; ONLY="skinny-off no-qkv no-o no-gate-up no-down"; T=220; fi
    echo "== $SHAPE"
    (cd scripts && PYTHONPATH=../src timeout $T python3 gpu_variants.py "$CK" --batches $B --context 512 \
        --max-model-len 2048 --rounds 5 --replays 20 --only $ONLY 2>&1 | tee "$OUT/skinny-$SHAPE.log" \
        | grep -E "^bs|rror|Trace")
done
