#!/usr/bin/env bash
# The server against LLM.generate on the same work, with default settings: 64 and 256 streams, the qwen3-0.6b and
# llama-3.1-8b shapes (random bf16 weights), 4 requests a stream of 256 prompt and 256 output tokens (greedy,
# ignore_eos), --max-model-len 2048 --max-num-seqs STREAMS, one run each. Each point is
# benchmarks/online/serve_vs_offline.py: LLM.generate at the server's step policy, then the server under
# `ostinato bench serve`, then under the independent client benchmarks/online/aiohttp_client.py (its own prompts, so
# the prefix cache the first run filled does not serve it). Prints one table; logs and JSON go to $OUT, each log
# with the time every phase began (a point cut short by an outer bound shows where it was).
#
#   bash benchmarks/online/server_vs_offline.sh
#   SHAPES=qwen3-0.6b STREAMS=64 EXTRA="--max-num-batched-tokens 8192" bash benchmarks/online/server_vs_offline.sh
#   grep -h '^\[' $OUT/*.log   # when each phase of each point began
#
# The server needs fastapi, uvicorn and pydantic, the client aiohttp: where they are missing, WHEELS=DIR installs
# them from a folder of wheels (no network).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}  # keep what the caller put there (e.g. a wheel folder)
OUT=${OUT:-/tmp/server-vs-offline}
SHAPES=${SHAPES:-"qwen3-0.6b llama-3.1-8b"}
STREAMS=${STREAMS:-"64 256"}
EXTRA=${EXTRA:-}
LOAD_TIMEOUT=${LOAD_TIMEOUT:-600}  # seconds each load run may take before it stops and says what the server holds
mkdir -p "$OUT"

if ! python3 -c "import fastapi, uvicorn, httptools, uvloop, pydantic, aiohttp" 2>/dev/null; then
  if [ -z "${WHEELS:-}" ]; then
    echo "fastapi, uvicorn, httptools, uvloop, pydantic or aiohttp is missing: set WHEELS=DIR (a folder of their wheels)" >&2
    exit 1
  fi
  python3 -m pip install -q --no-index --find-links "$WHEELS" fastapi uvicorn httptools uvloop pydantic aiohttp
fi

for shape in $SHAPES; do
  ck=/tmp/ck-$shape
  [ -f "$ck/config.json" ] || python3 -m ostinato make-checkpoint "$ck" --shape "$shape" --dtype bfloat16
  for n in $STREAMS; do
    echo "== $shape, $n streams" >&2
    # shellcheck disable=SC2086  # EXTRA is a list of flags
    python3 benchmarks/online/serve_vs_offline.py "$ck" --num-prompts $((4 * n)) --max-concurrency "$n" \
      --summary-json "$OUT/$shape-$n.json" --load-timeout "$LOAD_TIMEOUT" -- --max-model-len 2048 --max-num-seqs "$n" $EXTRA \
      >"$OUT/$shape-$n.log" 2>&1 || echo "   failed: see $OUT/$shape-$n.log" >&2
  done
done

python3 - "$OUT" $SHAPES -- $STREAMS <<'PY'
import json, os, sys

out, rest = sys.argv[1], sys.argv[2:]
shapes, streams = rest[:rest.index("--")], rest[rest.index("--") + 1:]
print("| shape | streams | LLM.generate tok/s | bench serve tok/s (/offline) | TTFT med ms | TPOT med ms "
      "| ITL med / p99 ms (p99/med) | aiohttp tok/s (/offline) | aiohttp ITL med / p99 ms |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for shape in shapes:
    for n in streams:
        path = os.path.join(out, f"{shape}-{n}.json")
        if not os.path.exists(path):
            print(f"| {shape} | {n} | failed: see {out}/{shape}-{n}.log |")
            continue
        r = json.load(open(path))
        off, bs, ind = r["offline"]["output_throughput"], r["bench_serve"], r["independent"]
        itl = bs["itl_ms"]
        row = [shape, n, f"{off:,.0f}", f"{bs['output_throughput']:,.0f} ({bs['output_throughput'] / off:.2f})",
               f"{bs['ttft_ms']['median']:.1f}", f"{bs['tpot_ms']['median']:.2f}",
               f"{itl['median']:.2f} / {itl['p99']:.2f} ({itl['p99'] / max(itl['median'], 1e-9):.1f}x)"]
        row += ([f"{ind['output_throughput']:,.0f} ({ind['output_throughput'] / off:.2f})",
                 f"{ind['itl_ms']['median']:.2f} / {ind['itl_ms']['p99']:.2f}"] if ind else ["", ""])
        print("| " + " | ".join(map(str, row)) + " |")
PY
