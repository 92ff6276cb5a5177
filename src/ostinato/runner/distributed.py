"""The tensor-parallel group of one engine: process-group set-up and the channel that carries each step.

Ranks are processes: rank 0 runs the engine (scheduler, detokenizer, server) and a ModelRunner; ranks 1..N-1
run only a ModelRunner (runner/tp_worker.py). Every rank runs the same SchedulerOutput through the same
runner, so the persistent decode batch is identical everywhere and the sampled tokens are too (the logits
are all-gathered before sampling); only rank 0 hands tokens back.

Two ways in, as torchrun users expect:
- `--tensor-parallel-size N` alone: rank 0 starts ranks 1..N-1 on this host (runner/tp_executor.py) and
  sends each step down a pipe per rank (a few microseconds; no collective on the step's critical path);
- RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT / LOCAL_RANK set (torchrun, or by hand on several nodes):
  every rank runs the same command; rank 0 runs the engine, the others become workers; steps go out with a
  gloo broadcast over a CPU group (works across hosts).

Device collectives (the model's all-reduces and all-gathers) use NCCL on CUDA and gloo on CPU; control
(agreeing on the KV block count, the torchrun step broadcast) uses a gloo group on the CPU.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import sys
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ostinato.errors import ConfigError
from ostinato.model.parallel import TPGroup

ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def leave_process(code: int) -> NoReturn:
    """End a torchrun-style rank's process now, with exit status `code`: atexit handlers run (rank 0's engine
    stops its workers there, runner/tp_executor.py), output is flushed, the interpreter's finalization is skipped.

    Why not a plain exit: after the program's last line, torch.distributed's C++ teardown (its store, gloo's
    threads) aborted the process now and then ("terminate called without an active exception", exit -6, no
    Python frame left: 2 runs in 8 of tests/runner/test_tensor_parallel.py's torchrun test with both cores busy, on
    rank 0 or rank 1, every process group destroyed first). The workers rank 0 launches itself always left by
    os._exit (runner/tp_worker.py main); torchrun-style ranks now do too. Pending `finally` blocks do not run."""
    atexit._run_exitfuncs()  # what a normal exit runs first; os._exit would skip it
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a broken pipe: nothing left to save
            pass
    os._exit(code)


def timeout_seconds() -> float:
    """How long a collective (and the rendezvous) may wait for a peer: $OSTINATO_TP_TIMEOUT_S, default 600
    (a slow rank may still be loading an 8B model from a cold disk)."""
    return float(os.environ.get("OSTINATO_TP_TIMEOUT_S", "600"))


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    launched_by_us: bool  # started by runner/tp_executor.py (pipes) rather than torchrun-style (gloo broadcast)


def env_rank_info() -> RankInfo | None:
    """This process's place from torchrun-style variables, or None when they are not set."""
    if not all(v in os.environ for v in ENV_VARS):
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    return RankInfo(rank, world, local, os.environ.get("OSTINATO_TP_LAUNCHED") == "1")


def check_world(info: RankInfo, tensor_parallel_size: int) -> None:
    if info.world_size != tensor_parallel_size:
        raise ConfigError(f"WORLD_SIZE is {info.world_size} but --tensor-parallel-size is {tensor_parallel_size}; "
                          "start as many ranks as the tensor-parallel size (torchrun --nproc-per-node N)")


def init_group(info: RankInfo, device_type: str, store: Any = None) -> tuple[TPGroup, Any]:
    """Join the process group: NCCL for the device collectives on CUDA (gloo on CPU) and a gloo CPU group
    for control. Returns (the model's TPGroup, the CPU group). On CUDA, binds this process to LOCAL_RANK."""
    timeout = timedelta(seconds=timeout_seconds())
    if device_type == "cuda":
        if info.local_rank >= torch.cuda.device_count():
            raise ConfigError(f"rank {info.rank} needs GPU {info.local_rank} but this host has "
                              f"{torch.cuda.device_count()}; lower --tensor-parallel-size or add GPUs")
        torch.cuda.set_device(info.local_rank)
    else:  # ranks share the host's cores: N ranks each spinning on all of them run many times slower
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // info.world_size))
    backend = "nccl" if device_type == "cuda" else "gloo"
    if dist.is_initialized():  # torchrun users may have set up the group themselves: use theirs
        if info.launched_by_us or dist.get_world_size() != info.world_size:
            raise ConfigError("a torch.distributed process group already exists in this process (another "
                              "tensor-parallel engine still running?); shut it down (llm.engine.shutdown()) first")
        cpu_group = dist.new_group(backend="gloo", timeout=timeout)
        return TPGroup(info.rank, info.world_size, dist.group.WORLD), cpu_group
    kwargs: dict[str, Any] = {"store": store} if store is not None else {"init_method": "env://"}
    if device_type == "cuda":
        kwargs["device_id"] = torch.device("cuda", info.local_rank)
    dist.init_process_group(backend, rank=info.rank, world_size=info.world_size, timeout=timeout, **kwargs)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    return TPGroup(info.rank, info.world_size, dist.group.WORLD), cpu_group


def agree_min(value: int, cpu_group: Any) -> int:
    """The smallest `value` over all ranks (e.g. the KV block count every rank can hold)."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=cpu_group)
    return int(t.item())


class PipeChannel:
    """Rank 0 -> workers over one pipe per worker (launched by us): pickled once, written N-1 times."""

    def __init__(self, writers: list[Connection] | None = None, reader: Connection | None = None):
        self._writers, self._reader = writers or [], reader

    def send(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for w in self._writers:
            w.send_bytes(data)

    def recv(self) -> Any:
        return pickle.loads(self._reader.recv_bytes())


class BroadcastChannel:
    """Rank 0 -> workers with a gloo broadcast over the CPU group (torchrun-style launch, any host)."""

    def __init__(self, cpu_group: Any, rank: int):
        self._group, self._rank = cpu_group, rank

    def send(self, message: Any) -> None:
        dist.broadcast_object_list([message], src=0, group=self._group)

    def recv(self) -> Any:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]


def check_ranks_agree(runner) -> None:
    """Diagnostic, run on every rank through call_all: raise when this rank's decode state (the rows it feeds
    and the tokens it sampled last) differs from the other ranks'. Every rank must sample the same tokens for
    the split model to stay one model; this proves it after a run (tests, `ostinato verify`)."""
    import torch

    tp = runner.tp
    rows = runner.decode_batch.host.long()
    sampled = runner.decode_step.sampled.long().cpu()
    weights = torch.arange(1, rows.numel() + 1, dtype=torch.int64).view_as(rows)
    state = torch.stack([rows.sum(), (rows * weights).sum(), sampled.sum(),
                         (sampled * torch.arange(1, sampled.numel() + 1)).sum()])
    device = runner.decode_step.sampled.device
    gathered = tp.gather_columns(state.to(device)[None, :]).view(tp.world_size, -1).cpu()  # [ranks, 4]
    differ = [r for r in range(tp.world_size) if not torch.equal(gathered[r], gathered[0])]
    if differ:
        raise RuntimeError(f"tensor-parallel ranks {differ} hold decode state different from rank 0's: the ranks "
                           "sampled different tokens (please report this)")
