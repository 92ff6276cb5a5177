#!/usr/bin/env bash
# `ostinato advise` on the GPU: one measuring run on a random checkpoint of SHAPE (default qwen3-0.6b), then
# two reports from those measurements: a chat-like workload (prompts 50-500, outputs 200-1000) and a
# summarization-like one (prompts 4000, outputs 64), both from 64 clients in a closed loop (only the lengths
# differ). Prints both verdicts. ~2-3 minutes on an H200 (about 1 minute of it making the checkpoint).
# Run from the repo root; OUT = a folder for reports, plots and the recommended sizes files.
set -euo pipefail
OUT=${OUT:-/tmp/ostinato-advise}; mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
SHAPE=${SHAPE:-qwen3-0.6b}
CK=${CK:-/tmp/ck-$SHAPE}
ENGINE="--max-model-len 8192 --max-num-seqs 256"
# host work around a decode step, the same with and without graphs (DESIGN.md: qwen3-0.6b on the H200, a whole
# engine step minus the forward-only replay: 0.16 ms at batch 1, 0.87 ms at batch 64)
HOST=${HOST:-0.15:0.0115}
[ -d "$CK" ] || python3 -m ostinato.cli make-checkpoint "$CK" --shape "$SHAPE" --dtype bfloat16 2>&1 | tail -2
t0=$(date +%s)
# 1. measure once (decode at 35 sizes x 3 contexts, prefill at 7 lengths, graph memory), report on chat
python3 -m ostinato.cli --log-level WARNING advise "$CK" $ENGINE --host-overhead-ms "$HOST" \
  --prompt-len 50:500 --output-len 200:1000 --num-requests 512 --concurrency 64 --name chat \
  --save-measurements "$OUT/measurements_$SHAPE.json" --out "$OUT/chat" --json "$OUT/chat.json" \
  2>&1 | tee "$OUT/chat.txt"
t1=$(date +%s)
# 2. re-advise from the saved measurements: no GPU work
python3 -m ostinato.cli --log-level WARNING advise "$CK" $ENGINE --host-overhead-ms "$HOST" \
  --prompt-len 4000 --output-len 64 --num-requests 512 --concurrency 64 --name summarization \
  --measurements "$OUT/measurements_$SHAPE.json" --out "$OUT/summarization" --json "$OUT/summarization.json" \
  2>&1 | tee "$OUT/summarization.txt"
t2=$(date +%s)
echo
echo "== $SHAPE: measure + chat report $((t1 - t0)) s, summarization report $((t2 - t1)) s"
echo "chat:          $(grep '^verdict:' "$OUT/chat.txt")"
echo "summarization: $(grep '^verdict:' "$OUT/summarization.txt")"
