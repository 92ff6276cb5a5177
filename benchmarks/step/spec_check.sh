#!/usr/bin/env bash
# Speculative decoding on one H200: the GPU tests, the verify step's cost on the 8B shape for k = 1..8 against
# a one-token decode step, and ngram on SmolLM2 with a prompt-repeating workload at batch 1 and 8 against no
# speculation (tok/s, acceptance, and whether the greedy outputs are identical).
#
#     bash benchmarks/step/spec_check.sh            # results under $OUT (default /tmp/spec-check)
#
# The 8B checkpoint is random weights at the public shape (speed does not depend on the values); it is made
# once with make-checkpoint (about 16 GB on disk):
#     python -m ostinato make-checkpoint /tmp/ck-8b --shape llama-3.1-8b --dtype bfloat16
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=src
OUT=${OUT:-/tmp/spec-check}
CK8B=${CK8B:-/tmp/ck-8b}
mkdir -p "$OUT"

echo "== GPU and CPU tests of speculative decoding"
python -m pytest -q -p no:cacheprovider tests/e2e/test_spec_gpu.py tests/runner/test_spec_verify.py \
    tests/engine/test_spec_engine.py

echo "== verify step at batch 1, llama-3.1-8b shape, k = 0..8 (prefill graphs at every k + 1)"
[ -f "$CK8B/config.json" ] || python -m ostinato make-checkpoint "$CK8B" --shape llama-3.1-8b --dtype bfloat16 --quiet
python -m ostinato bench verify "$CK8B" --log-level WARNING --speculative-method ngram --max-model-len 1024 \
    --gpu-memory-utilization 0.5 --cuda-graph-sizes 1 --prefill-graph-tokens 1,2,3,4,5,6,7,8,9,16 \
    --batch-size 1 --context 512 --max-k 8 --iters 50 --output-json "$OUT/verify-8b.json"

echo "== ngram on SmolLM2 (bf16), prompt-repeating workload, batch 1 and 8"
COMMON=(smollm2-135m --log-level WARNING --max-model-len 1024 --gpu-memory-utilization 0.5 --batch-sizes 1,8
        --max-tokens 128)
python -m ostinato bench spec "${COMMON[@]}" --output-json "$OUT/plain.json"
python -m ostinato bench spec "${COMMON[@]}" --speculative-method ngram --num-speculative-tokens 4 \
    --output-json "$OUT/ngram.json"
python -m ostinato bench spec "${COMMON[@]}" --dtype float32 --output-json "$OUT/plain-fp32.json"
python -m ostinato bench spec "${COMMON[@]}" --dtype float32 --speculative-method ngram \
    --num-speculative-tokens 4 --output-json "$OUT/ngram-fp32.json"

python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
for dtype in ("", "-fp32"):
    plain, spec = (json.load(open(f"{out}/{name}{dtype}.json")) for name in ("plain", "ngram"))
    for p, s in zip(plain["rows"], spec["rows"]):
        same = sum(a == b for a, b in zip(p["token_ids"], s["token_ids"]))
        print(f"{dtype[1:] or 'bf16'} batch {p['batch']}: {p['tokens_per_s']:.1f} -> {s['tokens_per_s']:.1f} tok/s "
              f"(x{s['tokens_per_s'] / p['tokens_per_s']:.2f}), acceptance {s['acceptance_rate']}, mean accepted "
              f"length {s['mean_accepted_length']}, greedy identical in {same} of {len(p['token_ids'])} requests")
PY
