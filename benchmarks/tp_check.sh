#!/usr/bin/env bash
# Tensor parallelism on a two-GPU host: the TP=2 gpu tests, `verify` on every rank, and TP=2 vs TP=1 decode
# latency on the llama-3.1-8b shape (graph vs eager, NCCL share). Each part is a command of its own below.
#
# A run that hangs inside the tests with nothing printed (output piped through `tail`) tells nothing. So every
# part streams its output, is bounded by `timeout`, runs with short collective timeouts, and dumps every
# thread's Python stack when it stalls: rank 0 through
# pytest's faulthandler_timeout, the worker ranks every $OSTINATO_TP_STACK_DUMP_S seconds (to stderr).
set -uo pipefail
OUT=${OUT:-/tmp/ostinato-tp}; mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export OSTINATO_TP_TIMEOUT_S=${OSTINATO_TP_TIMEOUT_S:-60} OSTINATO_TP_STACK_DUMP_S=${OSTINATO_TP_STACK_DUMP_S:-45}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
CK=${CK:-/tmp/ck-llama-3.1-8b}
case "${1:-all}" in
  probe|all) timeout 120 python3 -m ostinato.tools.tp_probe 2>&1 | tee "$OUT/probe.log" ;;&
  tests|all) timeout 300 python3 -m pytest -v -x -m gpu -o faulthandler_timeout=60 tests/runner/test_tp_gpu.py 2>&1 \
               | tee "$OUT/tests.log" ;;&
  bench|all) timeout 420 python3 -m ostinato.tools.bench.tp "$OUT" --checkpoint "$CK" 2>&1 | grep -v "it/s\]" \
               | tee "$OUT/tp_bench.log" ;;&
  verify|all) timeout 240 python3 -m ostinato.cli verify "$CK" -tp 2 --max-model-len 2048 --max-num-seqs 16 \
                --cuda-graph-sizes "1 2 4 8" --batch-sizes "1 3 9" 2>&1 | grep -v "it/s\]" | tee "$OUT/verify.log" ;;
esac
