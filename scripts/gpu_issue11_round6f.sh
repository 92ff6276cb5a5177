#!/usr/bin/env bash
# Issue 11, eleventh session, a short last call: the kernel-count test with the SwiGLU fold on, the few-rows and
# fold kernels' GPU tests with Llama-3.2-1B's qkv_proj now in the rule, and that rule against cuBLAS for it
# (skinny-off: every projection on cuBLAS) in whole steps; nano-vllm's workload on the 1B. Logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
echo "== gpu tests"
timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_skinny.py tests/test_glu_fold.py \
    "tests/test_fused_kernels.py::test_fused_kernels_cut_kernels_per_layer" 2>&1 | tee "$OUT/tests.log" \
    | grep -E "passed|failed|Error" | tail -8
source "$(dirname "$0")/gpu_variants_lib.sh"
variants llama-3.2-1b 1b-rule 70 "4 8 16" -- skinny-off
CK=/tmp/ck-llama-3.2-1b
echo "== throughput llama-3.2-1b"
timeout 90 python3 -m ostinato.cli --log-level WARNING bench throughput "$CK" --max-model-len 4096 \
    --gpu-memory-utilization 0.8 --output-json "$OUT/tput_1b.json" 2>&1 | grep -E "tok/s|rror|compiled [0-9]+ kernels" | grep -v Warn
