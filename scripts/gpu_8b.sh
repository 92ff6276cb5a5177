#!/usr/bin/env bash
# The llama-3.1-8b shape on the GPU machine: start-up memory report, generate, verify, bench vs eager vs HF.
set -uo pipefail
OUT=${OUT:-/tmp/ostinato-gpu}; mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
SHAPE=${SHAPE:-llama-3.1-8b}
CK=/tmp/ck-$SHAPE
[ -d "$CK" ] || python3 -m ostinato.cli make-checkpoint "$CK" --shape "$SHAPE" --dtype bfloat16 2>&1 | tail -1 | tee "$OUT/ckpt_$SHAPE.log"
python3 -m ostinato.cli generate "$CK" --max-model-len 2048 --prompt "Hello there" --max-tokens 32 2>&1 | grep -v "it/s\]" | tail -60 | tee "$OUT/startup_$SHAPE.log"
python3 -m ostinato.cli bench "$CK" --max-model-len 2048 --gpu-memory-utilization 0.6 --batch-sizes "${BS:-1 8 32 64}" --context 512 --iters 30 --output-json "$OUT/bench_$SHAPE.json" 2>&1 | grep -v "it/s\]" | tail -8 | tee "$OUT/bench_$SHAPE.log"
