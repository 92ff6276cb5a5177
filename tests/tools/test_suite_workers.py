"""How many pytest-xdist workers the suite starts (tests/conftest.py's pytest_xdist_auto_num_workers): one per core
as the memory allows, none on a CUDA machine or where only one would fit, and PYTEST_XDIST_AUTO_NUM_WORKERS wins."""

import os

import pytest
import torch

import conftest as suite_conftest  # tests/conftest.py, as pytest already imported it (the suite's only conftest)

GIB = 1 << 30


@pytest.fixture
def machine(monkeypatch):
    """Sets the machine the hook sees: (cores, memory in GiB, CUDA or not)."""
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)

    def set_machine(cores: int, memory_gib: int, cuda: bool = False):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
        sizes = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": memory_gib * GIB // 4096}
        monkeypatch.setattr(os, "sysconf", lambda name: sizes[name])
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    return set_machine


def test_one_worker_a_core_as_the_memory_allows(machine):
    machine(2, 16)
    assert suite_conftest.pytest_xdist_auto_num_workers(None) == 2
    machine(16, 24)
    assert suite_conftest.pytest_xdist_auto_num_workers(None) == 24 * GIB // suite_conftest.WORKER_MEMORY


def test_no_workers_on_a_cuda_machine_or_where_one_would_fit(machine):
    machine(16, 128, cuda=True)
    assert suite_conftest.pytest_xdist_auto_num_workers(None) == 0
    machine(1, 16)
    assert suite_conftest.pytest_xdist_auto_num_workers(None) == 0
    machine(8, suite_conftest.WORKER_MEMORY // GIB)
    assert suite_conftest.pytest_xdist_auto_num_workers(None) == 0


def test_the_variable_xdist_reads_wins(machine, monkeypatch):
    machine(2, 16)
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "3")
    assert suite_conftest.pytest_xdist_auto_num_workers(None) is None  # xdist's own hook then reads it
