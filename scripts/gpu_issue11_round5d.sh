#!/usr/bin/env bash
# Issue 11, ninth session, on the H200, call 4: each projection's and attention's cost inside whole decode steps
# (ablations in one process, scripts/gpu_variants.py), batches 1, 4, 16, context 512, the final tree. Logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for SHAPE in qwen3-0.6b llama-3.2-1b llama-3.1-8b; do
    CK=/tmp/ck-$SHAPE
    if [ $SHAPE = llama-3.1-8b ]; then B="1 16"; T=120; else B="1 4 16"; T=100; fi
    [ -d "$CK" ] || timeout 90 python3 -m ostinato.cli make-checkpoint "$CK" --shape $SHAPE --dtype bfloat16 2>&1 | tail -1
    echo "== $SHAPE"
    (cd scripts && PYTHONPATH=../src timeout $T python3 gpu_variants.py "$CK" --batches $B --context 512 \
        --max-model-len 2048 --rounds 6 --replays 20 --only no-qkv no-o no-gate-up no-down no-attention 2>&1 \
        | tee "$OUT/ablations-$SHAPE.log" | grep -E "^bs|rror|Trace")
done
