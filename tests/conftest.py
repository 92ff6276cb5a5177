import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

# Test the checkout these tests live in, whatever `pip install -e` pointed the environment at last.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
# Tests are grouped by layer (tests/engine, tests/server, ...). Some reuse another folder's fixtures by module
# name (`from test_server import TestServer`): every layer folder is importable, whatever pytest collects first.
# Shared helpers that belong to no single test module live in tests/support/.
_TESTS = Path(__file__).resolve().parent
for _layer in sorted(p for p in _TESTS.iterdir() if p.is_dir() and p.name not in ("support", "__pycache__")):
    sys.path.insert(0, str(_layer))

# Triton kernels run on CPU tensors under the interpreter; the variable must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# In a worker of pytest-xdist (pyproject.toml runs the suite in one per core), one intra-op thread: a thread pool
# in every worker puts two threads on each core, and OpenMP's threads spin while they wait for the others, so the
# workers slowed each other down more than they gained. The environment variable carries it to the processes the
# tests start (servers, engine cores, tensor-parallel ranks).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


# Memory a worker may need at its peak: it holds torch, Triton's interpreter and the tests' models, and some tests
# start processes of their own (servers, engine cores, tensor-parallel ranks); the heaviest modules reach about
# 3 GiB together.
WORKER_MEMORY = 4 << 30


def pytest_xdist_auto_num_workers(config):
    """How many worker processes `-n auto` starts: none on a CUDA machine, where the GPU tests would share one
    device's memory; else one per core this process may run on, as many as the memory holds."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # the variable xdist itself reads: its value wins
    if torch.cuda.is_available():
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    workers = min(cores, memory // WORKER_MEMORY)
    return workers if workers > 1 else 0  # one worker would only add its start-up


# Test modules skip themselves when these are missing (the GPU machine has no server stack), which in CI would
# turn a broken install into a few SKIPPED lines and drop dozens of tests. With CI set, a missing or broken one
# stops the run instead.
CI_REQUIRED_MODULES = ("triton", "fastapi", "uvicorn", "openai", "httpx", "hypothesis", "importlinter",
                       "compressed_tensors")


def pytest_configure(config):
    if os.environ.get("CI", "").lower() not in ("1", "true", "yes"):
        return
    broken = []
    for name in CI_REQUIRED_MODULES:
        try:
            importlib.import_module(name)
        except Exception as e:  # ImportError, or whatever a broken install raises on import
            broken.append(f"{name} ({type(e).__name__}: {e})")
    if broken:
        raise pytest.UsageError(f"CI=true but these test dependencies do not import: {', '.join(broken)}. Their "
                                "tests would be skipped, not run; install them (scripts/setup.sh), or unset CI "
                                "to run what this machine can.")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gc_settings_restored():
    """For tests that run code which freezes the heap or sets the collector's thresholds (engine/startup_heap.py,
    e.g. the engine core's loop run in this process): the heap starts unfrozen at Python's default young
    threshold, and pytest's own settings come back afterwards."""
    import gc

    thresholds = gc.get_threshold()
    gc.unfreeze()
    gc.set_threshold(700, *thresholds[1:])
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)
