#!/usr/bin/env bash
# Tensor parallelism on a two-GPU host: the TP=2 gpu tests, `verify` on every rank, and TP=2 vs TP=1 decode
# latency on the llama-3.1-8b shape (graph vs eager, NCCL share). Each part is a command of its own below.
set -uo pipefail
OUT=${OUT:-/tmp/ostinato-tp}; mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
CK=${CK:-/tmp/ck-llama-3.1-8b}
case "${1:-all}" in
  tests|all) python3 -m pytest -q -m gpu tests/test_tp_gpu.py 2>&1 | tail -15 | tee "$OUT/tests.log" ;;&
  bench|all) python3 -m ostinato.tools.tp_bench "$OUT" --checkpoint "$CK" 2>&1 | grep -v "it/s\]" | tee "$OUT/tp_bench.log" | tail -20 ;;&
  verify|all) python3 -m ostinato.cli verify "$CK" -tp 2 --max-model-len 2048 --max-num-seqs 16 \
                --cuda-graph-sizes "1 2 4 8" --batch-sizes "1 3 9" 2>&1 | grep -v "it/s\]" | tail -14 | tee "$OUT/verify.log" ;;
esac
