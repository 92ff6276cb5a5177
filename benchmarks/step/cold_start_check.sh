#!/usr/bin/env bash
# A first start on a machine (empty Triton cache) against a later one, on the llama-3.2-1b and llama-3.1-8b shapes:
# the decode graphs' capture time, what was compiled ahead of it (runner/compile_ahead.py) and what the capture
# still compiled, the memory profiling's and the whole start's time, where the compile time went
# (benchmarks/step/compile_times.py's "##" lines), and the warm start's step times (bs 1 and 64), to set beside
# docs/PERFORMANCE.md's. Then the GPU tests of the compile-ahead pass.
#
#     OUT=/tmp/cold bash benchmarks/step/cold_start_check.sh     # full logs under $OUT
#
# The checkpoints are random weights at the public shapes (compile and capture do not depend on the values),
# made once with make-checkpoint (the 8B about 16 GB on disk, about a minute).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=src
OUT=${OUT:-/tmp/cold-start}
mkdir -p "$OUT"

# The start-up log's lines shown for each start.
lines="loading weights|compiling the decode|profiling a worst|kernels ahead|captured [0-9]+ CUDA graphs"
lines+="|the capture compiled|memory profiling took|warmed the prefill|could not start|warm-up failed"
lines+="|step [0-9]+ of [0-9]+ failed"

for shape in llama-3.2-1b llama-3.1-8b; do
    ck=/tmp/ck-$shape
    [ -f "$ck/config.json" ] || python3 -m ostinato make-checkpoint "$ck" --shape "$shape" --dtype bfloat16 --quiet
    cache=$(mktemp -d)  # empty: the first start on this machine; the second run finds it filled
    for start in cold warm; do
        log="$OUT/$shape-$start.log"
        TRITON_CACHE_DIR=$cache python3 benchmarks/step/compile_times.py bench "$ck" --max-model-len 1024 \
            --gpu-memory-utilization 0.5 --batch-sizes 1,64 --context 512 --no-hf --iters 20 >"$log" 2>&1
        echo "== $shape, $start start (exit $?)"
        # With their times of day: the start runs from "loading weights" to "warmed the prefill path".
        grep -E "$lines" "$log" | sed -E 's/^[0-9-]+ ([0-9:,]+) (INFO|WARNING) [a-z_.]+: /\1 /' | cut -c1-600
        grep -E "^## (COMPILES|C MODULES)" "$log"
        grep -E "^## KERNEL" "$log" | head -8
        # Per kind of thread (compile_warmup: the warm-ups; compile: the steps; MainThread: in line): how many
        # compiles and C modules, their summed time, and the span from the first start to the last end.
        grep -E "^## T " "$log" | awk '{t = $5; sub(/_[0-9]+$/, "", t); n[t]++; s[t] += $4
            if (!(t in b) || $3 < b[t]) b[t] = $3; if ($3 + $4 > e[t]) e[t] = $3 + $4}
            END {for (t in n) printf "## BY THREAD %-16s n=%3d sum=%6.2f s from %6.2f to %6.2f s\n", t, n[t], s[t], b[t], e[t]}'
        grep -E "^## SLOW" "$log" | head -5
        [ "$start" = warm ] && grep -E "^bs " "$log"
    done
done

echo "== GPU tests: the capture compiles nothing the pass missed; deferred launches on CUDA"
python3 -m pytest -q -p no:cacheprovider tests/runner/test_compile_ahead.py tests/kernels/test_deferred_launch.py \
    tests/kernels/test_triton_attention.py tests/kernels/test_fused_kernels.py tests/kernels/test_sampling_kernel.py \
    -k "compile_ahead or deferred or cold_start or whole_model" 2>&1 | tail -5
