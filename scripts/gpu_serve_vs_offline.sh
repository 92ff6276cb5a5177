#!/usr/bin/env bash
# Issue 9's server goal on the GPU machine (run from the repo root): LLM.generate vs the server under bench serve,
# 256 requests x 256 prompt x 256 output tokens, 64 streams, --max-num-seqs 64, qwen3-0.6b shape. Prints both
# output tok/s and server/offline (goal >= 0.85), with the engine core in its own process (the default) and with
# the engine on a thread of the server (--engine-thread); then the same two on CPU with the forward replaced by a
# no-op that acts as a 3 ms GPU step (tools/bench/noop_forward.py: the host work alone, on this machine's CPUs), and one
# cProfile run of the default layout (where the server's event loop, its engine core and the load generator spend
# their time; cProfile slows each several times, so read its shares, not its rates).
#
# fastapi, uvicorn and pydantic must be importable; WHEELS=/dir/with/the/wheels installs them from there first.
set -uo pipefail
OUT=${OUT:-/tmp/ostinato-gpu}; mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ! python3 -c "import fastapi, uvicorn, pydantic" 2>/dev/null; then
  [ -n "${WHEELS:-}" ] || { echo "fastapi/uvicorn/pydantic missing: set WHEELS to the folder of their wheels"; exit 2; }
  python3 -m pip install -q --no-index --find-links "$WHEELS" fastapi uvicorn pydantic || exit 2
fi
SHAPE=${SHAPE:-qwen3-0.6b}
CK=/tmp/ck-$SHAPE
[ -d "$CK" ] || python3 -m ostinato.cli make-checkpoint "$CK" --shape "$SHAPE" --dtype bfloat16 2>&1 | tail -1
TINY=/tmp/ck-tiny-svo  # the no-op runs: host work only, on CPU (a GPU would replay its captured graphs anyway)
[ -d "$TINY" ] || python3 -m ostinato.cli make-checkpoint "$TINY" --shape tiny 2>&1 | tail -1
ENGINE="--max-num-seqs 64 --max-model-len 1024"
NOOP_ENGINE="$ENGINE --device cpu --dtype float32 --num-kv-blocks 4096"
run() {  # run NAME CHECKPOINT "ENGINE FLAGS" [serve_vs_offline flags]
  local name=$1 ck=$2 engine=$3; shift 3
  python3 scripts/serve_vs_offline.py "$ck" "$@" -- $engine 2>&1 | grep -v "it/s\]" > "$OUT/svo_${SHAPE}_$name.log"
  grep -E "Output tokens per chunk|CPU ms|load generator|server/offline" "$OUT/svo_${SHAPE}_$name.log" \
    | sed "s/^/[$name] /"
}
run process "$CK" "$ENGINE"
run thread "$CK" "$ENGINE" --engine-thread
run noop-process "$TINY" "$NOOP_ENGINE" --noop-forward --noop-forward-ms 3
run noop-thread "$TINY" "$NOOP_ENGINE" --noop-forward --noop-forward-ms 3 --engine-thread
run profile "$CK" "$ENGINE" --profile "$OUT/prof_$SHAPE"
grep -A 30 "==== front" "$OUT/svo_${SHAPE}_profile.log" | head -32
echo "logs and profiles in $OUT"
