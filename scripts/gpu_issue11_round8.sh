#!/usr/bin/env bash
# Issue 11, twelfth session, first call. (1) Decode attention at batch 16 (goal: >= 70% of HBM at context >= 512)
# and batch 1 (goal: <= 3 us a layer at context 512) against forced split counts and 128-token tiles, with
# today's kernel (PDL prefetch, single-launch merge): alone and as a step launches it, then in whole decode steps
# on Qwen3-0.6B and Llama-3.2-1B. (2) gpu_issue11_round7.sh: does launching down_proj or gate_up without PDL win
# back the gap the SwiGLU fold adds at 16 rows? Logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
echo "== attention alone"
timeout 130 python3 scripts/gpu_decode_attention.py --shapes qwen3-0.6b,llama-3.2-1b,llama-3.1-8b \
    --cases 1x512,16x512,16x2048 --pdl --attn s1:splits=1 s2:splits=2 s4:splits=4 s8:splits=8 xbn128:block_n=128 \
    --json "$OUT/attn-alone.json" 2>&1 | tee "$OUT/attn-alone.log" | grep -E "rope\+pdl|rror|Trace"
source "$(dirname "$0")/gpu_variants_lib.sh"
variants llama-3.2-1b 1b-attn 100 "1 16" -- attn-splits1 attn-splits4 attn-splits8 attn-bn128
variants qwen3-0.6b qwen3-attn 80 "16" -- attn-splits1 attn-splits4 attn-splits8 attn-bn128
bash "$(dirname "$0")/gpu_issue11_round7.sh"
