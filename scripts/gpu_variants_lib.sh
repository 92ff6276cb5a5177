# Sourced by the device-call scripts (gpu_issue11_round6d.sh ... round10c.sh): their common start (strict mode,
# unbuffered Python on src, $OUT, the CLI as $O), random checkpoints made on the device where missing, and one
# gpu_variants.py run with its log under $OUT and the step table printed.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
O="python3 -m ostinato.cli --log-level WARNING"

#   checkpoints SHAPE...   -> /tmp/ck-SHAPE, bf16 random weights at that public shape
checkpoints() {
    local shape
    for shape in "$@"; do
        [ -d /tmp/ck-$shape ] || timeout 90 $O make-checkpoint /tmp/ck-$shape --shape $shape --dtype bfloat16 2>&1 \
            | tail -1
    done
}

#   variants SHAPE LOGNAME TIMEOUT "BATCHES" -- VARIANT...
variants() {
    local shape=$1 log=$2 t=$3 b=$4; shift 5
    local ck=/tmp/ck-$shape
    checkpoints $shape
    echo "== $shape $log"
    (cd scripts && PYTHONPATH=../src timeout $t python3 gpu_variants.py "$ck" --batches $b --context 512 \
        --max-model-len 2048 --rounds 5 --replays 20 --only "$@" 2>&1 | tee "$OUT/$log.log" | grep -E "^bs|rror|Trace")
}
