#!/usr/bin/env bash
# Issue 11, ninth session, on the H200, call 3: the GPU tests of decode attention with the merge chunk of 8192,
# then attention alone, the new default against the old chunk (4096) in one process, plain and as a step
# launches it. Logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
echo "== gpu tests"
timeout 260 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_triton_attention.py tests/test_decode_replay.py \
    tests/test_pdl.py 2>&1 | tee "$OUT/tests.log" | tail -6
echo "== attention alone: default (8192) against c4k (4096)"
timeout 240 python3 scripts/gpu_decode_attention.py --cases 1x512,1x4096,1x32768,4x4096,16x512 --pdl \
    --attn c4k:merge_chunk_elems=4096 --json "$OUT/attn.json" 2>&1 | tee "$OUT/attn.log" | grep -v "^\s*$" \
    | awk '{printf "%-13s b%-3s ctx%-6s %-18s %7s %s\n",$1,$3,$5,$6,$7,$11}'
