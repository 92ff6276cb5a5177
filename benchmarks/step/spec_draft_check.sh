#!/usr/bin/env bash
# Speculative decoding with a draft model on one H200: the GPU tests of the draft method (with the CPU ones), then
# `bench spec` on a random llama-3.2-1b target with a random tiny draft of the same vocabulary (128256 tokens), at
# batch 1 and 8, without speculation and with the draft at forced acceptance rates P (--draft-acceptance): tok/s
# against no speculation, acceptance, and whether the greedy outputs are identical.
#
#     bash benchmarks/step/spec_draft_check.sh      # results under $OUT (default /tmp/spec-draft-check)
#
# Random weights at public shapes (speed does not depend on the values), made once with make-checkpoint.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=src
OUT=${OUT:-/tmp/spec-draft-check}
CK1B=${CK1B:-/tmp/ck-llama-3.2-1b}
CKDRAFT=${CKDRAFT:-/tmp/ck-draft-tiny-vocab128k}
mkdir -p "$OUT"

echo "== GPU and CPU tests of speculative decoding with a draft model"
# A failure is reported and the bench still runs (its figures say whether the failure matters to them).
python -m pytest -q -p no:cacheprovider tests/e2e/test_spec_draft_gpu.py tests/e2e/test_spec_gpu.py \
    tests/engine/test_spec_draft.py tests/runner/test_spec_verify.py tests/engine/test_spec_scheduler.py \
    || echo "== SOME TESTS FAILED (above)"

echo "== checkpoints: llama-3.2-1b target, tiny draft with its vocabulary"
[ -f "$CK1B/config.json" ] || python -m ostinato make-checkpoint "$CK1B" --shape llama-3.2-1b --dtype bfloat16 --quiet
[ -f "$CKDRAFT/config.json" ] || python -m ostinato make-checkpoint "$CKDRAFT" --shape tiny-vocab128k --dtype bfloat16 \
    --quiet

echo "== bench spec, batch 1 and 8: no speculation, then the draft at P = 0, 0.5, 0.8, 0.9, 1"
COMMON=("$CK1B" --log-level WARNING --max-model-len 1024 --gpu-memory-utilization 0.5 --batch-sizes 1,8
        --max-tokens 128)
python -m ostinato bench spec "${COMMON[@]}" --output-json "$OUT/plain.json"
python -m ostinato bench spec "${COMMON[@]}" --speculative-method draft --speculative-model "$CKDRAFT" \
    --num-speculative-tokens 4 --draft-acceptance 0,0.5,0.8,0.9,1 --output-json "$OUT/draft.json"

python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
plain = {r["batch"]: r for r in json.load(open(f"{out}/plain.json"))["rows"]}
for r in json.load(open(f"{out}/draft.json"))["rows"]:
    p = plain[r["batch"]]
    same = sum(a == b for a, b in zip(p["token_ids"], r["token_ids"]))
    print(f"batch {r['batch']} P {r['draft_acceptance']}: {p['tokens_per_s']:.1f} -> {r['tokens_per_s']:.1f} tok/s "
          f"(x{r['tokens_per_s'] / p['tokens_per_s']:.2f}), acceptance {r['acceptance_rate']}, mean accepted length "
          f"{r['mean_accepted_length']}, greedy identical in {same} of {len(p['token_ids'])} requests")
PY
