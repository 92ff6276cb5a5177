#!/usr/bin/env bash
# Issue 11, fourteenth session, call 4: what calls 2 and 3 (gpu_issue11_round10b.sh) lost or left out. Qwen3-0.6B's
# `bench peers` (its output fell out of call 2's tail), `bench kernels` at batch 16 with the few-rows kernel now
# counted as a projection, and the whole engine step (`bench engine`, LLM.generate's step with host work) at
# batches 1 and 64 on Qwen3-0.6B and Llama-3.2-1B.
source scripts/gpu_variants_lib.sh
checkpoints qwen3-0.6b llama-3.2-1b
CK=/tmp/ck-qwen3-0.6b
echo "== qwen3-0.6b bench peers"
timeout 150 $O bench peers $CK --max-model-len 2048 --gpu-memory-utilization 0.5 --cuda-graph-sizes 1 --context 512 \
    --iters 30 --output-json "$OUT/peers-qwen3-0.6b.json" 2>&1 | grep -v "it/s\]" | tail -3
echo "== qwen3-0.6b bench kernels, batch 16"
timeout 90 $O bench kernels $CK --max-model-len 2048 --gpu-memory-utilization 0.5 --cuda-graph-sizes 16 \
    --batch-sizes 16 --context 512 --top 4 --output-json "$OUT/kernels16-qwen3-0.6b.json" 2>&1 | grep -v "it/s\]" | tail -14
for SHAPE in qwen3-0.6b llama-3.2-1b; do
    echo "== $SHAPE bench engine (whole step, batches 1 and 64)"
    timeout 70 $O bench engine /tmp/ck-$SHAPE --max-model-len 1024 --gpu-memory-utilization 0.5 --batch-sizes 1,64 \
        --context 512 --output-json "$OUT/engine-$SHAPE.json" 2>&1 | grep -v "it/s\]" | tail -5
done
