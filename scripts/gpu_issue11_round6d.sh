#!/usr/bin/env bash
# Issue 11, eleventh session, the call after gpu_issue11_round6{,c}.sh: whole decode steps in one process
# (gpu_variants.py; A+B = both variants at once). (1) Qwen3-0.6B: why the SwiGLU fold lost 119 us a step at batch 16
# (the few-rows kernel's 16x256 s4 tiles there, 16x512 s3 at <= 4 rows, where it won) and the rule's projections
# one at a time (no-*) at batches 4, 8, 16; (2) Llama-3.2-1B: the fold at batch 1 with wider GEMV tiles (it saved
# 2 of the 13 us the activation costs), the few-rows kernel on one projection at a time, whole K and split in 4,
# at batches 4, 16; (3) Llama-3.1-8B: split-K few-rows o_proj and down_proj (alone 3-5% under cuBLAS) at 4, 16.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source "$(dirname "$0")/gpu_variants_lib.sh"
variants qwen3-0.6b qwen3-glu 150 "8 16" -- fold-glu skinny-16x512s3 fold-glu+skinny-16x512s3 skinny-32x256s3 \
    fold-glu+skinny-32x256s3
variants qwen3-0.6b qwen3-proj 150 "4 8 16" -- skinny-off no-qkv no-o no-gate-up no-down
variants llama-3.2-1b 1b-glu 100 "1" -- fold-glu gemv-bn-double fold-glu+gemv-bn-double
variants llama-3.2-1b 1b-skinny 200 "4 16" -- skinny-only- skinny-k4-
variants llama-3.1-8b 8b-split 150 "4 16" -- skinny-only-o skinny-only-down skinny-k4-o skinny-k4-down
