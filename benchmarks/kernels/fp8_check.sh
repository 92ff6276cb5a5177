#!/usr/bin/env bash
# FP8 weights on the GPU in one go (run from the repo root; OUT = a folder for logs and JSON): the FP8 GPU tests,
# the kernel sweep (benchmarks/kernels/fp8_linear.py) and the one-row chain against its read ceiling
# (benchmarks/kernels/fp8_stream_chain.py), then `ostinato bench` at batch 1 and 64 on the three public
# shapes, bf16 against FP8 (--quantization fp8 on the bf16 checkpoint, and a block-scaled FP8 checkpoint), printed
# as one table: graph step, eager step, floor (bytes actually read), floor ratio, FP8 / bf16.
# The GPU machine has no compressed-tensors: its layout is covered by the CPU tests; here FP8 comes from
# --quantization fp8 (per channel, as compressed-tensors' FP8_DYNAMIC) and from --fp8-layout block.
# KV=1 adds a fourth run, --quantization fp8 with --kv-cache-dtype fp8 (the FP8 KV cache), the table's "fp8+kv".
# ENGINE=1 adds, per shape, the whole engine step beside its replay (`bench engine`, batch 1 / 8 / 64), bf16 and FP8;
# THROUGHPUT=1 `bench throughput` (nano-vllm's workload), bf16 and FP8 (logs engine_* and throughput_* in OUT).
#   bash benchmarks/kernels/fp8_check.sh            (SHAPES="qwen3-0.6b llama-3.2-1b llama-3.1-8b" by default;
#                                                     TESTS=0 skips the tests, SWEEP=0 the kernel sweep)
set -uo pipefail
OUT=${OUT:-/tmp/ostinato-fp8}; mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
SHAPES=${SHAPES:-"qwen3-0.6b llama-3.2-1b llama-3.1-8b"}
BENCH=(--max-model-len 2048 --gpu-memory-utilization 0.6 --batch-sizes "1 64" --context 512 --no-hf)
if [ "${TESTS:-1}" = 1 ]; then
  timeout 600 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/kernels/test_fp8_linear.py \
    tests/kernels/test_fp8_stream.py tests/kernels/test_fp8_tokens.py tests/kernels/test_quantized_linear.py \
    tests/kernels/test_fp8_kv_cache.py \
    tests/kernels/test_fused_kernels.py::test_fp8_norms_after_o_and_down_give_the_logits_of_separate_kernels 2>&1 \
    | tail -30 | tee "$OUT/gpu_tests.log"
fi
if [ "${SWEEP:-1}" = 1 ]; then
  python3 benchmarks/kernels/fp8_linear.py --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"
  python3 benchmarks/kernels/fp8_stream_chain.py 2>&1 | tee "$OUT/stream_chain.log"
fi
for shape in $SHAPES; do
  ck=/tmp/ck-$shape ck8=/tmp/ck-$shape-fp8block
  [ -d "$ck" ] || python3 -m ostinato make-checkpoint "$ck" --shape "$shape" --dtype bfloat16 --quiet
  python3 -m ostinato bench "$ck" "${BENCH[@]}" --output-json "$OUT/$shape-bf16.json" 2>&1 | tail -4
  python3 -m ostinato bench "$ck" "${BENCH[@]}" --quantization fp8 --output-json "$OUT/$shape-fp8.json" 2>&1 | tail -4
  if [ "${KV:-0}" = 1 ]; then
    python3 -m ostinato bench "$ck" "${BENCH[@]}" --quantization fp8 --kv-cache-dtype fp8 \
      --output-json "$OUT/$shape-fp8kv.json" 2>&1 | tail -4
  fi
  for q in "" --quantization=fp8; do
    name=${q:+fp8}
    if [ "${ENGINE:-0}" = 1 ]; then
      timeout 590 python3 -m ostinato bench engine "$ck" $q --max-model-len 1024 --gpu-memory-utilization 0.5 \
        --batch-sizes 1,8,64 --context 512 2>&1 | tail -6 | tee "$OUT/engine_$shape-${name:-bf16}.log"
    fi
    if [ "${THROUGHPUT:-0}" = 1 ]; then
      timeout 590 python3 -m ostinato bench throughput "$ck" $q --max-model-len 4096 --gpu-memory-utilization 0.8 \
        2>&1 | tail -4 | tee "$OUT/throughput_$shape-${name:-bf16}.log"
    fi
  done
  [ -d "$ck8" ] || python3 -m ostinato make-checkpoint "$ck8" --shape "$shape" --dtype bfloat16 --quantization fp8 \
    --fp8-layout block --quiet
  python3 -m ostinato bench "$ck8" "${BENCH[@]}" --output-json "$OUT/$shape-fp8block.json" 2>&1 | tail -4
  rm -rf "$ck8"  # disk: the 8B shape's bf16 and FP8 folders together are 25 GB
done
python3 - "$OUT" $SHAPES <<'PY'
import json, sys
from pathlib import Path
out, shapes = Path(sys.argv[1]), sys.argv[2:]
print(f"{'shape':13s} {'weights':22s} {'bs':>3s} {'GB read':>7s} {'graph ms':>8s} {'eager ms':>8s} {'floor ms':>8s} "
      f"{'floor/graph':>11s} {'vs bf16':>7s}")
for shape in shapes:
    runs = {v: json.loads((out / f"{shape}-{v}.json").read_text()) for v in ("bf16", "fp8", "fp8kv", "fp8block")
            if (out / f"{shape}-{v}.json").is_file()}
    base = {r["batch"]: r["graph_ms"] or r["eager_ms"] for r in runs.get("bf16", {"rows": []})["rows"]}
    for name, run in runs.items():
        label = run.get("quantization", "?") + ("+kv" if name == "fp8kv" else "")
        for r in run["rows"]:
            step = r["graph_ms"] or r["eager_ms"]
            ratio = step / base[r["batch"]] if r["batch"] in base else float("nan")
            print(f"{shape:13s} {label:22s} {r['batch']:>3d} {run['weights_read_bytes'] / 1e9:7.2f} "
                  f"{r['graph_ms'] or float('nan'):8.3f} {r['eager_ms']:8.3f} {r['floor_ms']:8.3f} "
                  f"{r['floor_ratio']:11.2f} {ratio:7.2f}")
PY
