import os
import sys
from pathlib import Path

import pytest
import torch

# Test the checkout these tests live in, whatever `pip install -e` pointed the environment at last.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

# Triton kernels run on CPU tensors under the interpreter; the variable must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
