#!/usr/bin/env bash
# Issue 11, thirteenth session, last call: the tree with the slices of 0ab9d61 and the decode attention's PDL trigger
# placed by DecodeTuning.late_trigger_programs. (1) Whole Qwen3-0.6B steps: the rule against the trigger always
# first / always after the loop, and against the session's starting kernel (.base: git archive 20f4e48 src, the
# kernel main had until this session), one process. (2) GPU suites of what changed. (3) `bench` at batch 1 and
# `bench throughput` (nano-vllm's workload) on Qwen3-0.6B and Llama-3.2-1B.
source scripts/gpu_variants_lib.sh
checkpoints qwen3-0.6b llama-3.2-1b
echo "== qwen3-0.6b steps"
(cd scripts && PYTHONPATH=../src timeout 100 python3 gpu_variants.py /tmp/ck-qwen3-0.6b --batches 1 8 16 --context 512 \
    --max-model-len 2048 --rounds 5 --replays 20 --base-tree ../.base --only attn-trigger 2>&1 \
    | tee "$OUT/qwen3-rule.log" | grep -E "^bs|rror|Trace")
echo "== GPU suites"
timeout 200 python3 -m pytest -q -m gpu -x tests/test_pdl.py tests/test_decode_replay.py tests/test_triton_attention.py \
    tests/test_gpu_e2e.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -4
for SHAPE in qwen3-0.6b llama-3.2-1b; do
    CK=/tmp/ck-$SHAPE
    echo "== $SHAPE bench throughput"
    timeout 90 $O bench throughput "$CK" --max-model-len 4096 --gpu-memory-utilization 0.8 \
        --output-json "$OUT/tput-$SHAPE.json" 2>&1 | grep -E "tok/s|floor|rror" | grep -v Warn
done
echo "== qwen3-0.6b bench (forward-only replay, batch 1)"
timeout 60 $O bench /tmp/ck-qwen3-0.6b --max-model-len 1024 --gpu-memory-utilization 0.5 --cuda-graph-sizes 1 \
    --batch-sizes 1 --context 512 --no-hf --iters 200 --output-json "$OUT/bench-qwen3.json" 2>&1 | grep -v "it/s\]" | tail -4
