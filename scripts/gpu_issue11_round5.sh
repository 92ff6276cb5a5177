#!/usr/bin/env bash
# Issue 11, ninth session, on the H200, call 1: decode attention alone at batch 1 (context 512 to 32k), 16 and 64,
# plain and as a step launches it (RoPE in the kernel, PDL), with tuning variants that move the merge of the
# partials (the reduce kernel; a larger merge chunk; fewer slices; more programs); then the same variants inside
# whole decode steps of qwen3-0.6b at context 4096. Logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
VARIANTS="reduce:single_launch_max_splits=0 chunk8k:merge_chunk_elems=8192 ms16:max_splits=16 pps8:programs_per_sm=8 xbn32:block_n=32"
echo "== attention alone"
timeout 330 python3 scripts/gpu_decode_attention.py --cases ${CASES:-1x512,1x4096,1x32768,16x512,64x512} --pdl \
    --attn $VARIANTS --json "$OUT/attn.json" 2>&1 | tee "$OUT/attn.log" | grep -v "^\s*$"
CK=/tmp/ck-qwen3-0.6b
[ -d "$CK" ] || python3 -m ostinato.cli make-checkpoint "$CK" --shape qwen3-0.6b --dtype bfloat16 2>&1 | tail -1
echo "== qwen3-0.6b whole steps, context 4096, one process"
(cd scripts && PYTHONPATH=../src timeout 150 python3 gpu_variants.py "$CK" --batches 1 4 --context 4096 \
    --max-model-len 8192 --rounds 6 --replays 20 --only none --attn $VARIANTS 2>&1 | tee "$OUT/variants.log" \
    | grep -E "^bs|rror|Trace")
