"""Failures injected into a tensor-parallel worker rank, so tests can prove that one rank's failure stops every
rank with its cause.

`inject_failure(monkeypatch, "RANK:PHASE")` makes rank 0 start its workers through this module, which patches
the worker's own process before running the real worker (ostinato.runner.tp_worker.main). PHASE is "load"
(the rank fails building its runner), "capture" (its model syncs with the host, so its CUDA-graph capture
fails) or "stepN" (it fails at the N-th step rank 0 sends).
"""

from __future__ import annotations

import os
from pathlib import Path

FAULT_ENV = "OSTINATO_TEST_TP_FAULT"
TESTS_DIR = str(Path(__file__).resolve().parents[1])  # holds the `support` package


def inject_failure(monkeypatch, where: str) -> None:
    """Workers the engine starts while `monkeypatch` is active fail at `where` ("RANK:PHASE")."""
    from ostinato.runner import tp_executor

    monkeypatch.setattr(tp_executor, "WORKER_MODULE", __name__)
    monkeypatch.setenv(FAULT_ENV, where)
    # The worker imports this module by name: tests/ on its path (rank 0 adds ostinato's src/ before it).
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [TESTS_DIR, os.environ.get("PYTHONPATH")])))


def _fail_at_load(rank: int) -> None:
    from ostinato.runner import runner

    def failing_init(self, *args, **kwargs):
        raise RuntimeError(f"failure injected on rank {rank}")

    runner.ModelRunner.__init__ = failing_init


def _fail_at_capture() -> None:
    from ostinato.model import decoder

    build = decoder.DecoderForCausalLM.__init__

    def build_with_sync(model, *args, **kwargs):
        build(model, *args, **kwargs)
        model.debug_host_sync = True

    decoder.DecoderForCausalLM.__init__ = build_with_sync


def _fail_at_step(rank: int, step: int) -> None:
    from ostinato.runner import runner

    launch = runner.ModelRunner.launch
    steps = 0

    def failing_launch(self, out):
        nonlocal steps
        steps += 1
        if steps == step:
            raise RuntimeError(f"failure injected on rank {rank} at step {step}")
        return launch(self, out)

    runner.ModelRunner.launch = failing_launch


def _install(where: str, rank: int) -> None:
    target, _, phase = where.partition(":")
    if target != str(rank):
        return
    if phase == "load":
        _fail_at_load(rank)
    elif phase == "capture":
        _fail_at_capture()
    elif phase.startswith("step"):
        _fail_at_step(rank, int(phase.removeprefix("step")))
    else:
        raise ValueError(f"unknown failure phase {phase!r} in ${FAULT_ENV}")


if __name__ == "__main__":
    from ostinato.runner import tp_worker

    _install(os.environ.get(FAULT_ENV, ""), int(os.environ["RANK"]))
    tp_worker.main()
