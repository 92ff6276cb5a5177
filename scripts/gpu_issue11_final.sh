#!/usr/bin/env bash
# Issue 11, twelfth session: the goals' own commands on the final tree, one device call. Forward-only replay at
# batch 1 (`ostinato bench`, the goal's figure), the whole engine step at batches 1 and 64 (`bench engine`: what
# LLM.generate costs a step, host work included) and nano-vllm's workload (`bench throughput`) on Qwen3-0.6B and
# Llama-3.2-1B; then the 8B's batch-1 replay. SHAPES="..." picks shapes, ENGINE=0 skips `bench engine`. Logs and
# JSON under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
O="python3 -m ostinato.cli --log-level WARNING"
for SHAPE in ${SHAPES:-qwen3-0.6b llama-3.2-1b llama-3.1-8b}; do
    CK=/tmp/ck-$SHAPE
    [ -d "$CK" ] || timeout 120 $O make-checkpoint "$CK" --shape $SHAPE --dtype bfloat16 2>&1 | tail -1
    if [ $SHAPE = llama-3.1-8b ]; then IT=50; else IT=200; fi
    echo "== $SHAPE bench (forward-only replay, batch 1)"
    timeout 90 $O bench "$CK" --max-model-len 1024 --gpu-memory-utilization 0.5 --cuda-graph-sizes 1 --batch-sizes 1 \
        --context 512 --no-hf --iters $IT --output-json "$OUT/bench-$SHAPE.json" 2>&1 | grep -v "it/s\]" | tail -5
    [ $SHAPE = llama-3.1-8b ] && break
    [ "${ENGINE:-1}" = 0 ] || {
    echo "== $SHAPE bench engine (whole step, batches 1 and 64)"
    timeout 70 $O bench engine "$CK" --max-model-len 1024 --gpu-memory-utilization 0.5 --batch-sizes 1,64 \
        --context 512 --output-json "$OUT/engine-$SHAPE.json" 2>&1 | grep -v "it/s\]" | tail -5; }
    echo "== $SHAPE bench throughput"
    timeout 90 $O bench throughput "$CK" --max-model-len 4096 --gpu-memory-utilization 0.8 \
        --output-json "$OUT/tput-$SHAPE.json" 2>&1 | grep -E "tok/s|floor|rror|compiled [0-9]+ kernels" | grep -v Warn
done
