#!/usr/bin/env bash
# Issue 11, eighth session, on the H200: GPU tests of the 8B's norm fold and the sampling warm-up, the warm-up
# test without the warm-up (it must fail), nano-vllm's workload on the 1B (3 runs in one process), the 8B at
# batch 1 (bench, then the fold on/off in one process). Logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
echo "== gpu tests"
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gemv.py tests/test_fused_kernels.py \
    tests/test_compile_watch.py tests/test_pdl.py tests/test_decode_replay.py 2>&1 | tail -8
echo "== the many-prompts compile test with the sampling warm-up switched off (expected: 1 failed)"
timeout 90 python3 -c "
import sys, pytest, ostinato.runner.warmup as w
w.warm_up_sampling = lambda *a, **k: []
sys.exit(pytest.main(['-m', 'gpu', '-q', '-p', 'no:cacheprovider', '-k', 'many_prompts', 'tests/test_compile_watch.py']))
" 2>&1 | grep -E "passed|failed|assert|kernels_in_service|_kernel" | cut -c1-300 | head -8
echo "== throughput llama-3.2-1b"
SHAPE=llama-3.2-1b REPEATS=3 bash scripts/gpu_throughput_trees.sh
CK=/tmp/ck-llama-3.1-8b
[ -d "$CK" ] || python3 -m ostinato.cli make-checkpoint "$CK" --shape llama-3.1-8b --dtype bfloat16 2>&1 | tail -1
echo "== bench llama-3.1-8b batch 1"
timeout 120 python3 -m ostinato.cli --log-level WARNING bench "$CK" --max-model-len 1024 --gpu-memory-utilization 0.5 \
    --cuda-graph-sizes 1 --batch-sizes 1 --context 512 --no-hf --iters 50 --output-json "$OUT/bench_8b.json" 2>&1 \
    | grep -E "^bs|rror"
echo "== llama-3.1-8b batch 1: the fold (now default) against the norms apart, one process"
(cd scripts && PYTHONPATH=../src timeout 120 python3 gpu_variants.py "$CK" --batches 1 --max-model-len 1024 \
    --rounds 10 --replays 30 --only no-norm-fold 2>&1 | grep -E "^bs|rror")
