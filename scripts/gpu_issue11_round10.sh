#!/usr/bin/env bash
# Issue 11, fourteenth session, first call. (1) Whole decode steps at 2 and 4 rows with the GEMV taking the rows
# wherever it takes batch 1 (so the norms before qkv and gate_up fold into it, as at batch 1): Qwen3-0.6B and
# Llama-3.2-1B, one process each (scripts/gpu_variants.py gemv-rows*). (2) The decode attention alone and as a step
# launches it (RoPE, PDL), on main's kernel: the per-layer goals at batch 1 and 16.
source scripts/gpu_variants_lib.sh
checkpoints qwen3-0.6b llama-3.2-1b
for SHAPE in qwen3-0.6b llama-3.2-1b; do
    echo "== $SHAPE steps at 2 and 4 rows"
    (cd scripts && PYTHONPATH=../src timeout 170 python3 gpu_variants.py /tmp/ck-$SHAPE --batches 2 4 --context 512 \
        --max-model-len 2048 --rounds 5 --replays 20 --only gemv-rows 2>&1 \
        | tee "$OUT/$SHAPE-rows.log" | grep -E "^bs|rror|Trace")
done
echo "== decode attention alone and as a step launches it"
(cd scripts && PYTHONPATH=../src timeout 150 python3 gpu_decode_attention.py --shapes qwen3-0.6b,llama-3.2-1b \
    --cases 1x512,16x512,64x512,16x4096 --pdl 2>&1 | tee "$OUT/attention.log" | grep -vi warn)
