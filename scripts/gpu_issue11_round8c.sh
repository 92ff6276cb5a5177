#!/usr/bin/env bash
# Issue 11, twelfth session, third call (run on the tree of ec9cfb5 plus e37f366's rule; the attention change was
# reverted in 76b229b, so on main c17 / c9 / c5 compare forced counts with the ceil rule's): the rules as revised
# from gpu_issue11_round8b.sh, against what they replaced, in whole decode steps in one process: split counts rounded down (batch 4 / 8 / 16 now 16 / 8 / 4
# slices; the old 17 / 9 / 5 forced as attn:c17 / c9 / c5) and only the folded gate_up launched without PDL above
# 8 rows (skinny-pdl-on: with PDL); then the GPU suites of the kernels touched, and Qwen3-0.6B's batch-1 replay
# and nano-vllm's workload on the final tree. Logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source "$(dirname "$0")/gpu_variants_lib.sh"
OLD_SPLITS="--attn c17:splits=17 c9:splits=9 c5:splits=5"
variants qwen3-0.6b qwen3-rules 100 "4 8 16" -- skinny-pdl-on $OLD_SPLITS
variants llama-3.2-1b 1b-rules 60 "16" -- skinny-pdl-on --attn c5:splits=5
echo "== gpu tests"
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_decode_replay.py tests/test_gpu_e2e.py \
    tests/test_skinny.py tests/test_glu_fold.py tests/test_pdl.py tests/test_fused_kernels.py \
    2>&1 | tee "$OUT/tests.log" | grep -E "passed|failed|Error" | tail -12
SHAPES=qwen3-0.6b ENGINE=0 bash "$(dirname "$0")/gpu_issue11_final.sh"
