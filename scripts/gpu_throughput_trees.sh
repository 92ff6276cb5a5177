#!/usr/bin/env bash
# nano-vllm's workload (`bench throughput`) on one random checkpoint for several source trees and tunings, in one
# call, to find where a throughput change came from. Older trees: `git archive REV src | tar -x -C .trees/REV`.
#   SHAPE=llama-3.2-1b TREES=".trees/b23906a .trees/b8cea1c" bash scripts/gpu_throughput_trees.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SHAPE=${SHAPE:-llama-3.2-1b}
CK=/tmp/ck-$SHAPE
ARGS="--max-model-len 4096 --gpu-memory-utilization 0.8"
[ -d "$CK" ] || PYTHONPATH=src python3 -m ostinato.cli make-checkpoint "$CK" --shape "$SHAPE" --dtype bfloat16 2>&1 | tail -1
for TREE in . ${TREES:-}; do
    echo "== $TREE"
    REP=""; [ "$TREE" = . ] && REP="--repeats ${REPEATS:-3}"
    PYTHONPATH=$TREE/src timeout 150 python3 -m ostinato.cli --log-level WARNING bench throughput "$CK" $ARGS $REP \
        --output-json "$OUT/tput_$(basename "$TREE" | tr -c 'A-Za-z0-9\n' _).json" 2>&1 | grep -E "tok/s|rror|compiled [0-9]+ kernels" | grep -v Warn
done
for TUNE in ${TUNINGS:-}; do  # e.g. "num_warps=4 num_stages=2,num_warps=4"
    echo "== this tree, decode tuning $TUNE"
    PYTHONPATH=src timeout 150 python3 scripts/with_decode_tuning.py ${TUNE//,/ } -- --log-level WARNING bench throughput \
        "$CK" $ARGS --repeats "${REPEATS:-3}" 2>&1 | grep -E "tok/s|rror|decode tuning|compiled [0-9]+ kernels" | grep -v Warn
done
