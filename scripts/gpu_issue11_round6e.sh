#!/usr/bin/env bash
# Issue 11, eleventh session, last call: the rules set from gpu_issue11_round6{c,d}.sh (the SwiGLU fold on at <= 8
# rows, the few-rows kernel's 32 x 256 tiles at 5-8 rows) through the GPU suites, then against the old choices
# in whole decode steps in one process (no-glu-fold; skinny-16x256s4 = the old tiles above 4 rows), split-K
# few-rows projections with counters that outlive the graphs (round 6d's freed them), and nano-vllm's workload
# on Qwen3-0.6B. Logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
echo "== gpu tests"
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_skinny.py tests/test_glu_fold.py tests/test_gemv.py \
    tests/test_gpu_e2e.py tests/test_decode_replay.py tests/test_graphs_gpu.py tests/test_fused_kernels.py \
    2>&1 | tee "$OUT/tests.log" | grep -E "passed|failed|Error" | tail -8
source "$(dirname "$0")/gpu_variants_lib.sh"
variants qwen3-0.6b qwen3-rules 120 "1 4 8 16" -- no-glu-fold skinny-16x256s4 no-glu-fold+skinny-16x256s4
variants llama-3.2-1b 1b-split 120 "4 16" -- skinny-only-qkv skinny-only-down skinny-k4-qkv skinny-k4-down skinny-k2-down
variants llama-3.1-8b 8b-split 150 "1 4 16" -- no-glu-fold skinny-k4-o skinny-k4-down skinny-k8-down
echo "== throughput qwen3-0.6b"
PYTHONPATH=src timeout 150 python3 -m ostinato.cli --log-level WARNING bench throughput /tmp/ck-qwen3-0.6b \
    --max-model-len 4096 --gpu-memory-utilization 0.8 --output-json "$OUT/tput_qwen3.json" 2>&1 \
    | grep -E "tok/s|rror|compiled [0-9]+ kernels" | grep -v Warn
