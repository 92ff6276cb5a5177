#!/usr/bin/env bash
# Issue 11, for the next session's first call: test the lead for why the SwiGLU fold loses at 16 rows on
# Qwen3-0.6B (kernels no longer, gaps 91 -> 244 us a step; docs/PERFORMANCE.md, eleventh session). If
# launching down_proj (or gate_up) without PDL recovers the gap with the fold on, the lead holds and the fold can
# go on at 16 rows with that launch. Whole decode steps in one process; logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source "$(dirname "$0")/gpu_variants_lib.sh"
variants qwen3-0.6b qwen3-fold16 200 "8 16" -- fold-glu pdl-off-down pdl-off-gate-up fold-glu+pdl-off-down \
    fold-glu+pdl-off-gate-up fold-glu+skinny-32x256s3+pdl-off-down
