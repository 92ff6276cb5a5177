# Sourced by the device-call scripts (gpu_issue11_round6d.sh, 6e, 6f, 7): one gpu_variants.py run on a random checkpoint
# made on the device if missing, its log under $OUT, the step table printed.
#   variants SHAPE LOGNAME TIMEOUT "BATCHES" -- VARIANT...
variants() {
    local shape=$1 log=$2 t=$3 b=$4; shift 5
    local ck=/tmp/ck-$shape
    [ -d "$ck" ] || timeout 90 python3 -m ostinato.cli make-checkpoint "$ck" --shape $shape --dtype bfloat16 2>&1 | tail -1
    echo "== $shape $log"
    (cd scripts && PYTHONPATH=../src timeout $t python3 gpu_variants.py "$ck" --batches $b --context 512 \
        --max-model-len 2048 --rounds 5 --replays 20 --only "$@" 2>&1 | tee "$OUT/$log.log" | grep -E "^bs|rror|Trace")
}
