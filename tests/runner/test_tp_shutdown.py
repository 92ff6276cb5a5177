"""Rank 0's teardown order: the process group is torn down while the stopped workers tear down theirs, and only
then are they signalled; a teardown that does not return is aborted in bounded time. (NCCL tears a communicator
down with its peers: rank 0 used to kill the workers first and then wait in destroy_process_group for ever.)"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import torch.distributed as dist

from ostinato.runner import tp_executor
from ostinato.runner.tp_executor import TensorParallelRunner, _destroy_group, _stop_processes


def _sleeper(seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def test_a_teardown_that_hangs_is_aborted_within_its_timeout(monkeypatch):
    release, aborted = threading.Event(), []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: release.wait(10))
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", lambda: aborted.append(True))
    start = time.monotonic()
    _destroy_group(0.2)
    assert aborted == [True] and time.monotonic() - start < 2
    release.set()


def test_a_teardown_that_returns_is_not_aborted(monkeypatch):
    destroyed, aborted = [], []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: destroyed.append(True))
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", lambda: aborted.append(True))
    _destroy_group(5.0)
    assert destroyed == [True] and aborted == []


def test_a_stopped_worker_exits_by_itself_before_any_signal():
    proc = _sleeper(0.3)
    _stop_processes([SimpleNamespace(proc=proc)], wait=1.0, grace=5.0)
    assert proc.returncode == 0  # exited on its own: not SIGTERM's -15


def test_a_worker_that_does_not_exit_is_terminated_after_the_grace():
    proc = _sleeper(30)
    start = time.monotonic()
    _stop_processes([SimpleNamespace(proc=proc)], wait=2.0, grace=0.3)
    assert proc.returncode is not None and proc.returncode != 0 and time.monotonic() - start < 5


def test_shutdown_tears_the_group_down_while_the_workers_still_run(monkeypatch):
    proc = _sleeper(30)
    sent, alive_at_teardown = [], []
    runner = TensorParallelRunner.__new__(TensorParallelRunner)
    runner._closed, runner._failure, runner._owns_group = False, None, True
    runner._workers = [SimpleNamespace(proc=proc, rank=1)]
    runner.channel = SimpleNamespace(send=sent.append)
    monkeypatch.setattr(tp_executor, "_destroy_group", lambda timeout: alive_at_teardown.append(proc.poll() is None))
    monkeypatch.setattr(tp_executor, "WORKER_EXIT_S", 0.2)
    runner.shutdown()
    assert sent == [("stop",)]
    assert alive_at_teardown == [True]  # torn down beside the worker, not after it was killed
    assert proc.poll() is not None  # and the worker that did not exit was stopped after
