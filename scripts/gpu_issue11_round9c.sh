#!/usr/bin/env bash
# As run at 3e3ee77, with the GEMV/few-rows trigger knob of that working tree (not committed: it lost). Since
# 339a87d the field is late_trigger_programs (0: always after the loop) and the variants attn-trigger-late/-early.
# Issue 11, thirteenth session, third call. Round 9b: ec9cfb5's kernel (.base9) at batch 8 ran 8 active slices in
# one wave (512 programs) 64 us slower than main, but 130-163 us faster with 16-32 forced slices (the same 8
# active, the rest returning at once), and o_proj launched without PDL took 87 of those us back at 8 slices, 76 us
# off at batch 16. Reading: when a kernel's grid fits the GPU at once, its PDL trigger (first thing) lets the next
# kernel launch at once, whose few programs then sit on the few SMs with room and run there. Test: the trigger
# after the main loop (pdl-after-loop-*), on main's kernel and on ec9cfb5's slices (.base10 = this tree +
# ec9cfb5's attention diff).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
run() {  # SHAPE LOG TIMEOUT CONTEXT TABLE "BATCHES" VARIANTS...
    local shape=$1 log=$2 t=$3 ctx=$4 table=$5 b=$6; shift 6
    local ck=/tmp/ck-$shape
    [ -d "$ck" ] || timeout 90 python3 -m ostinato.cli make-checkpoint "$ck" --shape $shape --dtype bfloat16 2>&1 | tail -1
    echo "== $shape $log"
    (cd scripts && PYTHONPATH=../src timeout $t python3 gpu_variants.py "$ck" --batches $b --context $ctx \
        --max-model-len $table --rounds 5 --replays 20 --base-tree ../.base10 --attn late:dependents_after_loop=1 \
        --only "$@" 2>&1 | tee "$OUT/$log.log" | grep -E "^bs|rror|Trace")
}
run qwen3-0.6b qwen3-trigger 200 512 2048 "1 4 8 16" pdl-after-loop attn:late+base-attention \
    attn:late+base-attention+pdl-after-loop-proj
run llama-3.2-1b 1b-trigger 130 512 2048 "1 8 16" pdl-after-loop attn:late+base-attention
run qwen3-0.6b qwen3-trigger-2048 100 2048 4096 "16" pdl-after-loop-attn attn:late+base-attention
