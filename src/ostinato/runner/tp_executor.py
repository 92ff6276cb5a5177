"""Rank 0 of a tensor-parallel engine: start the other ranks, send them every step, stop them all.

`make_runner` is what the engine calls: a plain ModelRunner for one rank, else a TensorParallelRunner; both
satisfy the Runner protocol (runner/protocol.py). The latter wraps rank 0's own runner, starts the workers
with rank 0's RunnerConfig, and sends each SchedulerOutput to them before launching it locally
(runner/distributed.py).

Failure handling, so that no rank hangs:
- a worker that fails reports its cause (one JSON line on its stdout) and exits; a thread here reads it,
  stops the other workers, aborts the process group (a collective waiting on the dead rank returns an
  error instead of hanging) and any call on this runner raises TensorParallelError with that cause;
- if rank 0 stays stuck inside a collective anyway (a captured NCCL all-reduce cannot always be
  interrupted), the process exits after $OSTINATO_TP_GRACE_S (default 30) seconds, naming the cause;
- rank 0 failing (an exception here, Ctrl-C, SIGTERM, the process dying) stops the workers: shutdown()
  terminates them, and each worker exits by itself when its parent is gone;
- collectives and the rendezvous time out after $OSTINATO_TP_TIMEOUT_S.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ostinato.config import ParallelConfig, RunnerConfig
from ostinato.errors import TensorParallelError
from ostinato.model.parallel import check_tp_size
from ostinato.runner.distributed import (BroadcastChannel, PipeChannel, RankInfo, agree_min, check_world, env_rank_info,
                                         init_group, leave_process, timeout_seconds)
from ostinato.runner.runner import ModelRunner, pick_device
from ostinato.runner.tp_worker import CONFIG_ENV, resolve_call, run_worker, runner_config_env

logger = logging.getLogger(__name__)

# What rank 0 runs as `python -m` for each worker rank it starts (tests start theirs through a wrapper).
WORKER_MODULE = "ostinato.runner.tp_worker"


def make_runner(config: RunnerConfig, parallel: ParallelConfig):
    """The engine's runner: ModelRunner for --tensor-parallel-size 1, TensorParallelRunner above.

    Under torchrun-style variables (RANK > 0) this process is a worker: it serves rank 0 until rank 0 stops,
    then its process ends with status 0 (distributed.leave_process: atexit handlers run, `finally` blocks do
    not), so the same command or script runs on every rank."""
    size = parallel.tensor_parallel_size
    if size == 1:
        return ModelRunner(config)
    check_tp_size(config.model, size)
    info = env_rank_info()
    if info is not None and info.rank > 0:
        check_world(info, size)
        run_worker(config, info)
        leave_process(0)
    return TensorParallelRunner(config, parallel)


def _of_rank0(name: str) -> property:
    """A read-only attribute of rank 0's own runner (every rank holds the same graph and KV state)."""
    return property(lambda self: getattr(self.runner, name), doc=f"rank 0's runner's {name}")


class _Worker:
    """A worker process we started, its step pipe and what it reported."""

    def __init__(self, rank: int, proc: subprocess.Popen):
        self.rank, self.proc = rank, proc
        self.steps = Connection(os.dup(proc.stdin.fileno()), readable=False)
        proc.stdin.close()
        self.error: str | None = None
        self.watcher: threading.Thread | None = None  # reads its reports; records its exit as the failure


class TensorParallelRunner:
    """Rank 0's runner plus the workers; the engine sees a ModelRunner (attributes are rank 0's)."""

    def __init__(self, config: RunnerConfig, parallel: ParallelConfig):
        self.world_size = parallel.tensor_parallel_size
        self._workers: list[_Worker] = []
        self._failure: str | None = None
        self._busy = 0  # > 0 while the main thread is inside a call that may wait on other ranks
        self._closed = False
        self._owns_group = False
        info = env_rank_info()
        device_type = pick_device(config.device).type
        try:
            if info is None:  # we start the other ranks on this host
                store = self._start_workers(config)
                info = RankInfo(0, self.world_size, 0, True)
                self._channel_for = lambda _group: PipeChannel(writers=[w.steps for w in self._workers])
            else:  # torchrun-style: every rank runs this command; we are rank 0
                check_world(info, self.world_size)
                store = None
                self._channel_for = lambda group: BroadcastChannel(group, 0)
            with self._guard():
                self._owns_group = not _group_exists()
                tp, cpu_group = init_group(info, device_type, store)
                self.runner = ModelRunner(config, tp, lambda n: agree_min(n, cpu_group))
            self.channel = self._channel_for(cpu_group)
        except BaseException:
            self.shutdown()
            raise
        atexit.register(self.shutdown)  # a script or CLI command that never calls shutdown() stops every rank too

    # ---- start-up ------------------------------------------------------------------------------------
    def _start_workers(self, config: RunnerConfig):
        import torch.distributed as dist

        # Port 0: the store picks a free port itself (no race with other processes picking one).
        store = dist.TCPStore("127.0.0.1", 0, self.world_size, is_master=True, wait_for_workers=False,
                              timeout=_timedelta(timeout_seconds()))
        port = store.port
        src = str(Path(__file__).resolve().parents[2])  # the folder holding this ostinato package
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(self.world_size),
                   OSTINATO_TP_LAUNCHED="1", **{CONFIG_ENV: runner_config_env(config)},
                   OSTINATO_LOG_LEVEL=logging.getLevelName(logging.getLogger().getEffectiveLevel()),
                   PYTHONPATH=os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])]))
        for rank in range(1, self.world_size):
            proc = subprocess.Popen([sys.executable, "-m", WORKER_MODULE],
                                    env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=False)
            worker = _Worker(rank, proc)
            self._workers.append(worker)
            worker.watcher = threading.Thread(target=self._watch, args=(worker,), name=f"ostinato-tp-watch-{rank}",
                                              daemon=True)
            worker.watcher.start()
        deadline = time.monotonic() + timeout_seconds()
        keys = [f"ostinato/joined/{w.rank}" for w in self._workers]
        while not store.check(keys):  # wait for every worker to reach the store, or for one to fail
            self._raise_if_failed()
            if time.monotonic() > deadline:
                raise TensorParallelError(f"the tensor-parallel workers did not start within {timeout_seconds():.0f} s "
                                          "($OSTINATO_TP_TIMEOUT_S); see their log lines above")
            time.sleep(0.01)
        return store

    def _watch(self, worker: _Worker) -> None:
        """Read the worker's reports until it exits; a worker that exits before shutdown() is a failure."""
        for line in worker.proc.stdout:
            try:
                worker.error = json.loads(line).get("error", worker.error)
            except ValueError:
                pass
        code = worker.proc.wait()
        if self._closed:
            return
        cause = worker.error or f"the process exited with code {code}"
        self._fail(f"rank {worker.rank} failed: {cause}")

    def _fail(self, cause: str) -> None:
        if self._failure is not None:
            return
        self._failure = cause
        logger.error("tensor parallelism: %s; stopping every rank", cause)
        _stop_processes(self._workers)
        try:  # a collective waiting for the dead rank now errors out instead of hanging
            import torch.distributed as dist

            if dist.is_initialized():
                dist.distributed_c10d._abort_process_group()
        except Exception as e:  # noqa: BLE001 - best effort; the grace exit below is the backstop
            logger.warning("could not abort the process group: %s", e)
        grace = float(os.environ.get("OSTINATO_TP_GRACE_S", "30"))
        deadline = time.monotonic() + grace
        while self._busy and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._busy:
            logger.critical("tensor parallelism: rank 0 is still blocked %.0f s after %s; exiting", grace, cause)
            os._exit(1)

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise TensorParallelError(f"{self._failure}; every rank was stopped. Fix the cause and restart")

    def _await_failure(self, grace: float = 0.5) -> None:
        """After a call on this runner raised: a rank's failure often reaches us first as a collective or pipe
        error. Wait up to `grace` seconds for a worker to exit, then for its watcher to record why (it drains
        the worker's report first; a fixed sleep lost that race on a loaded machine)."""
        deadline = time.monotonic() + grace
        while self._failure is None and time.monotonic() < deadline:
            exited = [w for w in self._workers if w.proc.poll() is not None]
            for worker in exited:
                if worker.watcher is not None:
                    worker.watcher.join(timeout=10)
            if exited:
                return
            time.sleep(0.02)

    def _guard(self):
        runner = self

        class _Busy:
            def __enter__(self):
                runner._raise_if_failed()
                runner._busy += 1

            def __exit__(self, kind, exc, tb):
                runner._busy -= 1
                if exc is not None and runner._failure is None and kind is not KeyboardInterrupt:
                    runner._await_failure()
                if exc is not None and runner._failure is not None:
                    raise TensorParallelError(f"{runner._failure}; every rank was stopped. Fix the cause and "
                                              "restart") from exc
                return False

        return _Busy()

    # ---- what the engine calls -----------------------------------------------------------------------
    def launch(self, out, masks=None):
        # Every rank samples the same tokens from the same logits: a grammar mask on rank 0 alone would break
        # that, so the engine refuses constrained requests under tensor parallelism (engine/grammar.py).
        assert masks is None, "structured outputs are not supported with tensor parallelism"
        with self._guard():
            self.channel.send(("step", out))
            return _GuardedStep(self.runner.launch(out), self)

    def execute(self, out):
        return self.launch(out).result()

    def call_all(self, target: str, *args: Any) -> Any:
        """Run `target` ("module:function", taking the runner first) on every rank; rank 0's result."""
        import torch

        with self._guard(), torch.inference_mode():
            self.channel.send(("call", target, args))
            return resolve_call(target)(self.runner, *args)

    def rank_health(self) -> list[dict]:
        """Per rank: alive or not, and its failure cause. Ranks started by torchrun are not ours to watch: they
        count as alive until a collective with them fails. Rank 0 counts as stopped as soon as a worker has
        exited: its watcher stops every rank once it has drained the worker's reports, and /health must not
        show rank 0 serving in between."""
        exited = [w for w in self._workers if w.proc.poll() is not None]
        stopping = None if self._closed or not exited else f"stopping: rank {exited[0].rank} exited"
        rank0_error = self._failure or stopping
        ranks = [{"rank": 0, "alive": rank0_error is None, "error": rank0_error}]
        for w in self._workers:
            ranks.append({"rank": w.rank, "alive": w.proc.poll() is None, "error": w.error})
        for rank in range(len(ranks), self.world_size):
            ranks.append({"rank": rank, "alive": self._failure is None, "error": None})
        return ranks

    @property
    def failure(self) -> str | None:
        return self._failure

    def shutdown(self) -> None:
        """Stop every worker (idempotent): a stop message, the process group torn down beside the workers tearing
        down theirs, then each worker given time to exit before SIGTERM and SIGKILL.

        Why in this order: NCCL tears a communicator down together with its peers. Rank 0 used to kill the workers
        first and destroy its group after, alone, and on two H200s it waited in destroy_process_group forever."""
        if self._closed:
            return
        self._closed = True
        channel = getattr(self, "channel", None)
        stopped = False
        if channel is not None and self._failure is None:
            try:
                channel.send(("stop",))
                stopped = True
            except Exception:  # noqa: BLE001 - a worker already gone
                pass
        if self._owns_group:  # frees the group, so that this process can start another tensor-parallel engine
            _destroy_group(GROUP_TEARDOWN_S if stopped else FAILED_TEARDOWN_S)
        _stop_processes(self._workers, wait=5.0, grace=WORKER_EXIT_S if stopped else 0.0)

    # ---- the rest of the Runner protocol (runner/protocol.py): rank 0's runner's ---------------------------
    cache_config = _of_rank0("cache_config")
    dtype = _of_rank0("dtype")
    block_size = _of_rank0("block_size")
    kv_dtype = _of_rank0("kv_dtype")
    compile_watch = _of_rank0("compile_watch")
    graph_status = _of_rank0("graph_status")
    graphs_enabled = _of_rank0("graphs_enabled")
    graph_disabled_cause = _of_rank0("graph_disabled_cause")
    captured_sizes = _of_rank0("captured_sizes")
    graph_memory_bytes = _of_rank0("graph_memory_bytes")
    prefill_graph_memory_bytes = _of_rank0("prefill_graph_memory_bytes")
    graph_capture_seconds = _of_rank0("graph_capture_seconds")

    def graph_stats(self):
        return self.runner.graph_stats()

    def prefill_graph_stats(self):
        return self.runner.prefill_graph_stats()

    def __getattr__(self, name: str):  # everything else is rank 0's runner's (graph state, KV config, ...)
        if name == "runner":
            raise AttributeError(name)
        return getattr(self.runner, name)


class _GuardedStep:
    """A PendingStep whose result() turns a rank's failure into TensorParallelError."""

    def __init__(self, pending, owner: TensorParallelRunner):
        self._pending, self._owner = pending, owner

    @property
    def seq_ids(self):
        return self._pending.seq_ids

    def result(self):
        with self._owner._guard():
            return self._pending.result()


def _group_exists() -> bool:
    import torch.distributed as dist

    return dist.is_initialized()


# Seconds rank 0 waits for its group's teardown beside stopped workers (then aborts it), for that teardown after a
# failure (the group was aborted already), and for a stopped worker to exit by itself before SIGTERM.
GROUP_TEARDOWN_S = 20.0
FAILED_TEARDOWN_S = 5.0
WORKER_EXIT_S = 10.0


def _destroy_group(timeout: float) -> None:
    """destroy_process_group, bounded: run on a thread, and the group aborted if it has not returned in `timeout`
    (a peer that died mid-teardown must not hold rank 0 for ever)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    done = threading.Event()

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - after an abort the group may be half torn down
            logger.debug("destroy_process_group: %s", e)
        finally:
            done.set()

    threading.Thread(target=destroy, name="tp-group-teardown", daemon=True).start()
    if done.wait(timeout):
        return
    logger.warning("tensor parallelism: the process group's teardown took over %.0f s; aborting it", timeout)
    try:
        dist.distributed_c10d._abort_process_group()
    except Exception as e:  # noqa: BLE001 - best effort: the process can still exit
        logger.warning("could not abort the process group: %s", e)


def _stop_processes(workers: list[_Worker], wait: float = 2.0, grace: float = 0.0) -> None:
    """Each worker given `grace` seconds to exit by itself (it was told to stop), then SIGTERM, `wait` seconds,
    SIGKILL."""
    deadline = time.monotonic() + grace
    for w in workers:
        try:
            w.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for w in workers:
        if w.proc.poll() is None:
            w.proc.terminate()
    deadline = time.monotonic() + wait
    for w in workers:
        try:
            w.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.proc.kill()


def _timedelta(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)
