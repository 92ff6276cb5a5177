#!/usr/bin/env bash
# Issue 11, eleventh session: why the SwiGLU fold loses at 16 rows on Qwen3-0.6B (gemv.choose_glu_fold). Per
# kernel times (`bench kernels`, the profiler on an eager launch of a step) at batches 8 and 16 with the fold
# as the rule has it (on at 8, off at 16) and with the fold forced on at 16. Logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
CK=/tmp/ck-qwen3-0.6b
[ -d "$CK" ] || timeout 60 python3 -m ostinato.cli make-checkpoint "$CK" --shape qwen3-0.6b --dtype bfloat16 2>&1 | tail -1
for MAX in 8 16; do
    echo "== fold up to $MAX rows"
    timeout 50 python3 -c "
import sys, ostinato.kernels.gemv as g
g.GLU_FOLD_MAX_ROWS = $MAX
from ostinato.cli import main
sys.exit(main(['--log-level', 'WARNING', 'bench', 'kernels', '$CK', '--max-model-len', '2048',
               '--cuda-graph-sizes', '8,16', '--batch-sizes', '8,16', '--context', '512', '--top', '8',
               '--skip-graph-check', '--output-json', '$OUT/kernels-fold$MAX.json']))
" 2>&1 | tee "$OUT/kernels-fold$MAX.log" | grep -v "Warn\|compiled" | tail -40
done
