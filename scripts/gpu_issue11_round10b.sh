#!/usr/bin/env bash
# Issue 11, fourteenth session, calls 2 and 3 (SHAPES=llama-3.1-8b): every goal of the issue measured on main's tree, per shape (SHAPES, default the two
# small ones; the 8B in a call of its own): `bench` at batch 1 (forward-only replay against the floor), `bench peers`
# (HF eager and HF static cache + torch.compile in the same run), `bench kernels` at batch 1 and 16, and for the 8B
# `bench throughput` (nano-vllm's workload). JSON and PNGs land in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
O="python3 -m ostinato.cli --log-level WARNING"
SHAPES=${SHAPES:-"qwen3-0.6b llama-3.2-1b"}
for SHAPE in $SHAPES; do
    CK=/tmp/ck-$SHAPE
    [ -d $CK ] || timeout 200 $O make-checkpoint $CK --shape $SHAPE --dtype bfloat16 2>&1 | tail -1
    echo "== $SHAPE bench (forward-only replay, batch 1)"
    timeout 90 $O bench $CK --max-model-len 1024 --gpu-memory-utilization 0.5 --cuda-graph-sizes 1 --batch-sizes 1 \
        --context 512 --no-hf --iters 200 --output-json "$OUT/bench-$SHAPE.json" --plot "$OUT/bench-$SHAPE.png" 2>&1 \
        | grep -v "it/s\]" | tail -4
    echo "== $SHAPE bench peers"
    timeout 200 $O bench peers $CK --max-model-len 2048 --gpu-memory-utilization 0.5 --cuda-graph-sizes 1 --context 512 \
        --iters 30 --output-json "$OUT/peers-$SHAPE.json" --plot "$OUT/peers-$SHAPE.png" 2>&1 | grep -v "it/s\]" | tail -8
    if [ "$SHAPE" = llama-3.1-8b ]; then
        echo "== $SHAPE bench throughput"
        timeout 150 $O bench throughput $CK --max-model-len 4096 --gpu-memory-utilization 0.8 \
            --output-json "$OUT/tput-$SHAPE.json" 2>&1 | grep -E "tok/s|floor|rror" | grep -v Warn
    else
        echo "== $SHAPE bench kernels"
        timeout 120 $O bench kernels $CK --max-model-len 2048 --gpu-memory-utilization 0.5 --cuda-graph-sizes "1 16" \
            --batch-sizes "1 16" --context 512 --top 6 --output-json "$OUT/kernels-$SHAPE.json" \
            --plot "$OUT/kernels-$SHAPE.png" 2>&1 | grep -v "it/s\]" | tail -40
    fi
done
