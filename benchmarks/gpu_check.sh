#!/usr/bin/env bash
# GPU checks in one go (run from the repo root on the GPU machine; OUT = a folder for logs):
# the gpu-marked tests, then generate / verify / bench on a random checkpoint of a public shape.
set -uo pipefail
OUT=${OUT:-/tmp/ostinato-gpu}; mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
SHAPE=${SHAPE:-qwen3-0.6b}
CK=/tmp/ck-$SHAPE
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$OUT/gpu.txt"
if [ "${TESTS:-1}" = 1 ]; then
  timeout 300 python3 -m pytest -m gpu tests -q -x -p no:cacheprovider 2>&1 | tail -60 | tee "$OUT/gpu_tests.log"
fi
[ -d "$CK" ] || python3 -m ostinato.cli make-checkpoint "$CK" --shape "$SHAPE" --dtype bfloat16 2>&1 | tail -3 | tee "$OUT/ckpt.log"
python3 -m ostinato.cli generate "$CK" --max-model-len 2048 --prompt "Hello there" --prompt "A B C" --max-tokens 32 2>&1 | tail -40 | tee "$OUT/generate_$SHAPE.log"
python3 -m ostinato.cli verify "$CK" --max-model-len 2048 --max-num-seqs 128 --batch-sizes "1 3 8 64 128" 2>&1 | tail -20 | tee "$OUT/verify_$SHAPE.log"
python3 -m ostinato.cli bench "$CK" --max-model-len 2048 --gpu-memory-utilization 0.5 --batch-sizes "1 8 32 64" --context 512 --output-json "$OUT/bench_$SHAPE.json" 2>&1 | tail -20 | tee "$OUT/bench_$SHAPE.log"
