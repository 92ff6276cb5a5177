#!/usr/bin/env bash
# As run at 0ab9d61 + the working tree; since 339a87d the field is late_trigger_programs (late: =0).
# Issue 11, thirteenth session, fourth call: where the decode attention's PDL trigger should go, on the slices of
# 0ab9d61 (cut over the cached tokens, split counts rounded down). The trigger first thing (default) against after
# the K/V loop (attn:late) at batches 1-64, context 512 (64 is an unsplit launch), and batch 1 at context 4096, on
# Qwen3-0.6B, Llama-3.2-1B and Llama-3.1-8B, whole decode steps in one process.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
run() {  # SHAPE LOG TIMEOUT CONTEXT TABLE "BATCHES"
    local shape=$1 log=$2 t=$3 ctx=$4 table=$5 b=$6
    local ck=/tmp/ck-$shape
    [ -d "$ck" ] || timeout 150 python3 -m ostinato.cli make-checkpoint "$ck" --shape $shape --dtype bfloat16 2>&1 | tail -1
    echo "== $shape $log"
    (cd scripts && PYTHONPATH=../src timeout $t python3 gpu_variants.py "$ck" --batches $b --context $ctx \
        --max-model-len $table --rounds 5 --replays 20 --attn late:dependents_after_loop=1 --only none \
        2>&1 | tee "$OUT/$log.log" | grep -E "^bs|rror|Trace")
}
run qwen3-0.6b qwen3-late 120 512 2048 "1 2 4 8 16 32 64"
run llama-3.2-1b 1b-late 100 512 2048 "1 4 8 16 32 64"
run qwen3-0.6b qwen3-late-4096 60 4096 8192 "1 4"
run llama-3.1-8b 8b-late 200 512 2048 "1 8 16 32"
