#!/usr/bin/env bash
# Issue 11, twelfth session, second call (run on the tree of ec9cfb5 plus the few-rows PDL rule of then, every
# few-rows launch above 8 rows without PDL; the attention change was reverted in 76b229b): (1) the decode attention's slices cut over the cached tokens (the
# newest token no longer opens a slice of its own) against main's kernel (--base-tree .base: `git archive
# 20f4e48 src | tar -x -C .base`), whole decode steps at batches 1, 4, 16; (2) the few-rows kernel without PDL
# above 8 rows and the SwiGLU fold at 16 rows (the new rules) against PDL on (skinny-pdl-on), the old rule
# (no-glu-fold+skinny-pdl-on) and PDL off for gate_up / gate_up and down alone; (3) 4 slices at batch 16 (the
# split rule gives 5: 640 programs where 512 fit at once), contexts 512 and 2048; (4) the GPU suites of the kernels
# touched. Logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source "$(dirname "$0")/gpu_variants_lib.sh"
BASE="--base-tree $PWD/.base"
variants qwen3-0.6b qwen3-slices 90 "1 4 16" -- base-attention $BASE
variants qwen3-0.6b qwen3-pdl16 90 "16" -- skinny-pdl-on no-glu-fold+skinny-pdl-on \
    skinny-pdl-on+pdl-off-gate-up skinny-pdl-on+pdl-off-gate-up+pdl-off-down attn-splits4
echo "== qwen3-0.6b context 2048, batch 16: 4 slices (512 programs) against the rule's 5 (640)"
(cd scripts && PYTHONPATH=../src timeout 60 python3 gpu_variants.py /tmp/ck-qwen3-0.6b --batches 16 --context 2048 \
    --max-model-len 4096 --rounds 5 --replays 20 --only attn-splits4 $BASE 2>&1 | tee "$OUT/qwen3-ctx2048.log" \
    | grep -E "^bs|rror|Trace")
variants llama-3.2-1b 1b-slices 90 "1 16" -- base-attention skinny-pdl-on $BASE
echo "== gpu tests"
timeout 220 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_decode_replay.py tests/test_gpu_e2e.py \
    tests/test_triton_attention.py tests/test_skinny.py tests/test_glu_fold.py tests/test_pdl.py tests/test_fused_kernels.py \
    2>&1 | tee "$OUT/tests.log" | grep -E "passed|failed|Error" | tail -12
