#!/usr/bin/env bash
# Issue 11, ninth session, on the H200, call 2: the merge chunk (8192 and 16384 fp32 against 4096) and more,
# thinner split programs at batch 16, alone (plain and as a step launches it) and inside whole decode steps of
# qwen3-0.6b and llama-3.2-1b at context 512 and 4096, one process per shape and context. Logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
VARIANTS="chunk8k:merge_chunk_elems=8192 chunk16k:merge_chunk_elems=16384 c16w8:merge_chunk_elems=16384,split_num_warps=8 p8w2:programs_per_sm=8,split_num_warps=2"
echo "== attention alone"
timeout 200 python3 scripts/gpu_decode_attention.py --cases 1x512,1x4096,4x4096,16x512 --pdl \
    --attn $VARIANTS --json "$OUT/attn.json" 2>&1 | tee "$OUT/attn.log" | grep -v "^\s*$" \
    | awk '{printf "%-13s b%-3s ctx%-6s %-22s %7s %s\n",$1,$3,$5,$6,$7,$11}'
for SHAPE in qwen3-0.6b llama-3.2-1b; do
    CK=/tmp/ck-$SHAPE
    [ -d "$CK" ] || python3 -m ostinato.cli make-checkpoint "$CK" --shape $SHAPE --dtype bfloat16 2>&1 | tail -1
    for CTX in 512 4096; do
        if [ $CTX = 512 ]; then B="1 16"; MML=2048; else B="1 4"; MML=8192; fi
        echo "== $SHAPE whole steps, context $CTX, table $MML"
        (cd scripts && PYTHONPATH=../src timeout 100 python3 gpu_variants.py "$CK" --batches $B --context $CTX \
            --max-model-len $MML --rounds 6 --replays 20 --only none --attn $VARIANTS 2>&1 \
            | tee "$OUT/variants-$SHAPE-$CTX.log" | grep -E "^bs|rror|Trace")
    done
done
