#!/usr/bin/env bash
# GGUF kept quantized, on the GPU (run from the repo root; OUT = a folder for logs). STEPS picks the parts, each
# under 10 minutes on one H200 (default all, in this order):
#   tests    the gpu-marked GGUF kernel tests (and the CPU ones, now on CUDA)
#   kernels  the GGUF kernels beside bf16 at Llama-3.1-8B's projection shapes, batch 1/8/64
#   sweep    (not in the default) the GGUF kernels' tile settings (gguf_linear.py --sweep), Q4_K and Q6_K, 1 and 8 rows
#   make     random llama-3.1-8b checkpoints: bf16 folder, Q8_0 and Q4_K_M GGUF files (under CK; MODELS picks,
#            default "bf16 Q8_0 Q4_K_M"; Q8_0 quantizes 8B floats with the gguf library, minutes)
#   bench    `ostinato bench` of those at batch 1/8/64 (floors count the bytes actually read)
#   load     start-up time and peak host memory of the loader alone (benchmarks/step/gguf_load.py): Q4_K_M first
#            start, cached start, then --gguf-dequantize (that converts to a 32 GB float32 folder: the bf16 folder
#            is removed first for the disk)
#   smollm2  the real SmolLM2: Q4_1 blocks vs the dequantized folder, graph vs eager, vs HF (logprob-close)
set -uo pipefail
OUT=${OUT:-/tmp/ostinato-gguf}; mkdir -p "$OUT"
CK=${CK:-/tmp/ck-gguf}
STEPS=${STEPS:-tests kernels make bench load smollm2}
MODELS=${MODELS:-bf16 Q8_0 Q4_K_M}
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export OSTINATO_CACHE_DIR=${OSTINATO_CACHE_DIR:-$CK/cache}
SHAPE=llama-3.1-8b
has() { [[ " $STEPS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
if has tests; then
  timeout 590 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gguf_gpu.py \
    tests/kernels/test_gguf_linear.py tests/kernels/test_quantized_linear.py \
    tests/kernels/test_decode_quantized_output.py tests/model/test_gguf_native.py 2>&1 | tail -30 \
    | tee "$OUT/gguf_tests.log"
fi
if has kernels; then
  timeout 590 python3 benchmarks/kernels/gguf_linear.py --batches 1 8 64 --json "$OUT/gguf_linear.json" 2>&1 \
    | tail -80 | tee "$OUT/gguf_linear.log"
fi
if has sweep; then
  timeout 400 python3 benchmarks/kernels/gguf_linear.py --sweep --types Q4_K Q6_K --batches 1 8 2>&1 \
    | tee "$OUT/gguf_sweep.log" | grep -E "^##|^   |WRONG|failed"
fi
model_path() { if [ "$1" = bf16 ]; then echo "$CK/bf16"; else echo "$CK/$1/model.gguf"; fi; }
if has make; then
  for T in $MODELS; do
    if [ "$T" = bf16 ]; then
      [ -d "$CK/bf16" ] || python3 -m ostinato.cli make-checkpoint "$CK/bf16" --shape $SHAPE --dtype bfloat16 --quiet
    else
      [ -f "$CK/$T/model.gguf" ] || python3 -m ostinato.cli make-checkpoint "$CK/$T" --shape $SHAPE --format gguf \
        --gguf-type $T --quiet
    fi
  done
  ls -la "$CK"/*/model.gguf | tee "$OUT/make.log"
fi
if has bench; then
  for name in $MODELS; do
    M=$(model_path "$name")
    timeout 590 python3 -m ostinato.cli bench "$M" --max-model-len 2048 --gpu-memory-utilization 0.6 \
      --batch-sizes "1 8 64" --context 512 --no-hf --output-json "$OUT/bench_$name.json" 2>&1 | tail -12 \
      | tee "$OUT/bench_$name.log"
  done
fi
if has load; then
  # The loader alone (benchmarks/step/gguf_load.py): no KV cache or graphs in the host memory it reports.
  LOAD=(python3 benchmarks/step/gguf_load.py "$CK/Q4_K_M/model.gguf" --device cuda)
  rm -rf "$CK/bf16" "$CK/load-cache"  # disk: the float32 folder below is 32 GB
  export OSTINATO_CACHE_DIR=$CK/load-cache  # empty: the first starts parse and convert from nothing
  for flag in "" --gguf-dequantize; do
    for start in first cached; do
      echo "Q4_K_M ${flag:-native}, $start start:" | tee -a "$OUT/load.log"
      "${LOAD[@]}" $flag 2>&1 | tail -1 | tee -a "$OUT/load.log"
    done
  done
fi
if has smollm2; then
  timeout 590 python3 benchmarks/smollm2_gpu.py --max-tokens 64 2>&1 | tail -20 | tee "$OUT/smollm2.log"
fi
