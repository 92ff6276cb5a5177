#!/usr/bin/env bash
# Issue 12 on the GPU machine (llama-3.1-8b shape, random bf16 weights): the GPU tests, TTFT with a cached prefix
# vs uncached, decode inter-token latency while an 8k prompt is prefilled (chunked, then unchunked for contrast),
# and nano-vllm's throughput with both features on and off. Figures land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/ostinato-gpu}; mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
SHAPE=${SHAPE:-llama-3.1-8b}
CK=/tmp/ck-$SHAPE
G="--gpu-memory-utilization ${GMU:-0.85}"
[ -d "$CK" ] || python3 -m ostinato.cli make-checkpoint "$CK" --shape "$SHAPE" --dtype bfloat16 2>&1 | tail -1
python3 -m pytest -q -m gpu tests/test_prefix_chunked_gpu.py tests/test_gpu_e2e.py tests/test_graphs_gpu.py tests/test_decode_batch.py tests/test_triton_attention.py 2>&1 | tail -5 | tee "$OUT/pytest_gpu_12.log"
# (a) goal: cached TTFT <= 20% of uncached (4,096 tokens, 3,584 cached).
python3 -m ostinato.cli bench prefix "$CK" $G --max-model-len 4608 --prompt-len 4096 --cached-len 3584 --iters 5 \
  --output-json "$OUT/prefix_$SHAPE.json" 2>&1 | grep -v "it/s\]" | tail -2 | tee "$OUT/prefix_$SHAPE.log"
# (b) goal: p99 ITL of 32 decodes <= 2x their median while an 8,192-token prompt is prefilled. Budgets: the
# default (2048), smaller chunks, and one step for the whole prompt (what happened before chunking).
for T in ${BUDGETS:-2048 512 256 8448}; do
  python3 -m ostinato.cli bench chunked "$CK" $G --max-model-len 8448 --max-num-seqs 64 --max-num-batched-tokens "$T" \
    --prompt-len 8192 --num-decodes 32 --decode-context 256 --base-steps 64 \
    --output-json "$OUT/chunked_${SHAPE}_$T.json" 2>&1 | grep -v "it/s\]" | tail -1 | tee "$OUT/chunked_${SHAPE}_$T.log"
done
# Throughput on nano-vllm's workload must not drop with both features on (prompts are random: no prefix hits).
for F in "" "--no-enable-prefix-caching --max-num-batched-tokens 8192"; do
  python3 -m ostinato.cli bench throughput "$CK" --max-model-len 4096 $G $F 2>&1 | grep -v "it/s\]" | tail -1 \
    | tee -a "$OUT/throughput_12_$SHAPE.log"
done
