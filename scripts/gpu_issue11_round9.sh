#!/usr/bin/env bash
# Issue 11, thirteenth session, first call: the lead the twelfth left. Qwen3-0.6B at batch 8 took 205 us less a
# step with 17 forced slices than with 8 or 9, the same slices holding tokens. Is it the extra empty programs
# (grid), or the compiled kernel (SPLITS_PAD 32 and a 32-slice merge tile: registers, so fewer programs an SM)?
# attn-pad32/pad16 compile the rule's launch with the larger merge tile and keep its grid; attn-maxnreg caps the
# registers; pdl-off-o/qkv: whether the neighbours' early launch is what the slices change. --kernel-stats prints
# registers and programs an SM of every compiled attention kernel. Then the GPU suites on main's tree.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source "$(dirname "$0")/gpu_variants_lib.sh"
variants qwen3-0.6b qwen3-slices 150 "8 16" -- attn-pad32 attn-pad16 attn-maxnreg pdl-off-o pdl-off-qkv \
    --attn c17:splits=17 c9:splits=9 --kernel-stats
grep -E "^attention kernel" "$OUT/qwen3-slices.log"
variants llama-3.2-1b 1b-slices 110 "8 16" -- attn-pad32 attn-maxnreg128 --attn c17:splits=17 --kernel-stats
grep -E "^attention kernel" "$OUT/1b-slices.log"
echo "== GPU suites"
timeout 250 python3 -m pytest -q -m gpu -x tests/test_triton_attention.py tests/test_skinny.py tests/test_decode_replay.py \
    tests/test_glu_fold.py tests/test_pdl.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -15
