#!/usr/bin/env bash
# Issue 9's server goal on the GPU machine (run from the repo root; fastapi, uvicorn and pydantic importable):
# LLM.generate vs the server under bench serve, 256 requests x 256 prompt x 256 output tokens, 64 streams,
# --max-num-seqs 64, qwen3-0.6b shape. Prints both output tok/s and server/offline (goal >= 0.85), first with
# the engine core in its own process (the default), then with the engine on a thread of the server (before).
set -uo pipefail
OUT=${OUT:-/tmp/ostinato-gpu}; mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
SHAPE=${SHAPE:-qwen3-0.6b}
CK=/tmp/ck-$SHAPE
[ -d "$CK" ] || python3 -m ostinato.cli make-checkpoint "$CK" --shape "$SHAPE" --dtype bfloat16 2>&1 | tail -1
for mode in process thread; do
  flag=""; [ "$mode" = thread ] && flag="--engine-thread"
  python3 scripts/serve_vs_offline.py "$CK" $flag -- --max-num-seqs 64 --max-model-len 1024 2>&1 \
    | grep -v "it/s\]" | tail -32 | tee "$OUT/serve_vs_offline_${SHAPE}_$mode.log"
done
