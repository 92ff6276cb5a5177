#!/usr/bin/env bash
# Branch hB on the H200, from the repo root (about 3 minutes; every section is bounded by `timeout`):
#   bash scripts/gpu_hB_check.sh
# The GPU tests of the single-launch decode (split-KV merged by the last-arriving program, q/k norm + RoPE +
# K/V write inside it), the fused prefill RoPE + K/V write, the graph/engine tests, then a determinism stress:
# one captured decode replayed 2000 times per shape (bit-identical to eager every time), two graph engines on
# the same schedule (identical tokens and logprobs), graph vs eager end to end again at batch 25 and 33.
# The log streams to $OUT/gpu_hB_check.log (pytest -v --tb=short -rf: failures print as they happen, and
# again in each section's summary, even if a later section is killed). The last line is PASS or FAIL.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LOG=$OUT/gpu_hB_check.log; : > "$LOG"
PYTEST=(python3 -m pytest -v --tb=short -rf -p no:cacheprovider)
declare -a RESULTS=()
FAILED=0

section() {  # section NAME SECONDS pytest-args...
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s): $*" | tee -a "$LOG"
  local start=$SECONDS
  timeout -k 10 "$limit" "${PYTEST[@]}" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]} verdict=PASS
  case $rc in
    0) ;;
    124|137) verdict="FAIL (timed out after ${limit}s)" ;;
    5) verdict="FAIL (no tests collected)" ;;
    *) verdict="FAIL (pytest exit $rc)" ;;
  esac
  [[ $verdict == PASS ]] || FAILED=1
  RESULTS+=("$name: $verdict in $((SECONDS - start))s")
}

nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>&1 | tee -a "$LOG"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 | tee -a "$LOG"
if ! python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  echo "hB GPU CHECK: FAIL (no CUDA device: every test below would only be skipped)" | tee -a "$LOG"; exit 1
fi

section "decode + fused kernels" 120 -m gpu tests/test_triton_attention.py tests/test_fused_kernels.py \
  tests/test_decode_replay.py tests/test_triton_prefill_split.py tests/test_attention_ref.py
section "graphs + engine" 75 -m gpu tests/test_gpu_e2e.py tests/test_decode_batch.py tests/test_graphs_gpu.py \
  tests/test_graph_path_engine.py tests/test_prefix_chunked_gpu.py tests/test_compile_watch.py
OSTINATO_DECODE_REPLAYS=2000 section "determinism stress" 40 -m gpu tests/test_decode_replay.py \
  tests/test_gpu_e2e.py -k "bit_identical or twice or (graph_replay_matches_eager and (25 or 33))"

{
  echo
  echo "== summary"
  printf '%s\n' "${RESULTS[@]}"
  grep -E "^(FAILED|ERROR) " "$LOG" | sort -u
  if [[ $FAILED == 0 ]]; then echo "hB GPU CHECK: PASS"; else echo "hB GPU CHECK: FAIL"; fi
} 2>&1 | tee -a "$LOG"
exit $FAILED
