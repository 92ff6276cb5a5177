#!/usr/bin/env bash
# Issue 11, thirteenth session, second call. Round 9 found no 17-slice gain on main's kernel (batch 8: +5.7 us;
# the merge tile padded to 32 slices: +18.5). The lead came from ec9cfb5's kernel (slices over the cached tokens,
# split counts rounded down: 8 at batch 8). Here that kernel (.base9 = git archive ec9cfb5 src) at 8, 16, 17 and
# 32 forced slices (the same 8 active, merge tiles of 8, 16, 32, 32 slices) and with o_proj launched without PDL,
# against main's kernel, in one process.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
CK=/tmp/ck-qwen3-0.6b
[ -d "$CK" ] || timeout 90 python3 -m ostinato.cli make-checkpoint "$CK" --shape qwen3-0.6b --dtype bfloat16 2>&1 | tail -1
(cd scripts && PYTHONPATH=../src timeout 200 python3 gpu_variants.py "$CK" --batches 8 16 --context 512 \
    --max-model-len 2048 --rounds 5 --replays 20 --base-tree ../.base9 \
    --attn c8:splits=8 c16:splits=16 c17:splits=17 c32:splits=32 \
    --only attn:c8+base-attention attn:c16+base-attention attn:c17+base-attention attn:c32+base-attention \
    pdl-off-o+base-attention 2>&1 | tee "$OUT/base9.log" | grep -E "^bs|rror|Trace")
