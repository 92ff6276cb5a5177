"""A tensor-parallel worker rank (ranks 1..N-1): build the same ModelRunner as rank 0, then run every
message rank 0 sends until it says stop.

Messages (runner/distributed.py carries them): ("step", SchedulerOutput) runs a step exactly as rank 0
does (its tokens are dropped: rank 0 returns them); ("call", "module:function", args) runs
function(runner, *args) on every rank (bench, verify); ("stop",) ends the loop.

Started two ways: by rank 0 (runner/tp_executor.py) as `python -m ostinato.runner.tp_worker`, with the
engine arguments in $OSTINATO_TP_ARGS, steps on stdin and failures reported as one JSON line on stdout; or
by the user's own command under torchrun (cli.py / LLM call `run_worker` when RANK > 0).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import threading
import time
import traceback
from dataclasses import asdict, replace
from multiprocessing.connection import Connection
from typing import Any

from ostinato.config import EngineArgs, ModelConfig
from ostinato.errors import ConfigError
from ostinato.runner.distributed import ENV_VARS, BroadcastChannel, PipeChannel, RankInfo, agree_min, init_group

logger = logging.getLogger(__name__)


def resolve_call(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def serve_rank(args: EngineArgs, info: RankInfo, channel_for, store: Any = None) -> None:
    """Build this rank's runner and run rank 0's messages until ("stop",). channel_for(cpu_group) -> channel."""
    from ostinato.model.gguf_sources import resolve_model_dir
    from ostinato.runner.runner import ModelRunner, pick_device

    model_dir = resolve_model_dir(args.model)
    args = replace(args, model=str(model_dir))
    model_config = ModelConfig.from_dir(model_dir)
    tp, cpu_group = init_group(info, pick_device(args.device).type, store)
    fail_at = _injected_failure(info.rank)
    if fail_at == "load":
        raise RuntimeError(f"failure injected on rank {info.rank} by $OSTINATO_TP_INJECT_FAILURE")
    if fail_at == "capture":  # a host sync inside the model: this rank's CUDA-graph capture fails
        from ostinato.model import decoder

        build = decoder.DecoderForCausalLM.__init__

        def build_with_sync(model, *a, **k):
            build(model, *a, **k)
            model.debug_host_sync = True

        decoder.DecoderForCausalLM.__init__ = build_with_sync
    runner = ModelRunner(args, model_config, args.scheduler_config(model_config), tp,
                         lambda n: agree_min(n, cpu_group))
    channel = channel_for(cpu_group)
    steps = 0
    while True:
        message = channel.recv()
        if message[0] == "stop":
            break
        if message[0] == "step":
            steps += 1
            if fail_at == f"step{steps}":
                raise RuntimeError(f"failure injected on rank {info.rank} at step {steps} by $OSTINATO_TP_INJECT_FAILURE")
            runner.launch(message[1])  # rank 0 reads the tokens; this rank's copy of them is not needed
        elif message[0] == "call":
            import torch

            with torch.inference_mode():  # as rank 0's callers (bench, verify) run them
                resolve_call(message[1])(runner, *message[2])


def _injected_failure(rank: int) -> str | None:
    """Test hook: $OSTINATO_TP_INJECT_FAILURE="RANK:load", "RANK:capture" (its graph capture fails) or
    "RANK:stepN" makes that rank fail there, so tests prove that one rank's failure stops every rank with its
    cause."""
    where = os.environ.get("OSTINATO_TP_INJECT_FAILURE", "")
    target, _, phase = where.partition(":")
    return phase if target == str(rank) else None


def run_worker(args: EngineArgs, info: RankInfo) -> None:
    """A torchrun-style worker: steps come over a gloo broadcast from rank 0.

    The group this function created is destroyed here, in order, while rank 0 may still host the store; a group
    the user set up before (torchrun scripts may) is theirs to keep. That alone did not stop the process from
    aborting in torch's teardown after its last line now and then, so the callers end it by
    distributed.leave_process."""
    import torch.distributed as dist

    owns_group = not dist.is_initialized()
    serve_rank(args, info, lambda cpu_group: BroadcastChannel(cpu_group, info.rank))
    if owns_group and dist.is_initialized():
        dist.destroy_process_group()


def run_env_worker(ns) -> int:
    """A CLI command (its parsed arguments `ns`) started on rank > 0 by torchrun-style variables."""
    from ostinato.cli_args import engine_args_from
    from ostinato.runner.distributed import check_world, env_rank_info

    args = engine_args_from(ns)
    info = env_rank_info()
    if info is None:
        raise ConfigError(f"RANK is set but not all of {', '.join(ENV_VARS)} are; set every one of them")
    check_world(info, args.tensor_parallel_size)
    run_worker(args, info)
    return 0


def _watch_parent(parent_pid: int) -> None:
    """Exit when rank 0 is gone (killed, crashed): never outlive it, whatever this rank is blocked on."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(3)


def main() -> None:
    # Keep fd 1 for reports to rank 0; anything else printed goes to stderr with the logs.
    report = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    logging.basicConfig(level=os.environ.get("OSTINATO_LOG_LEVEL", "WARNING"),
                        format=f"[rank {os.environ.get('RANK')}] %(levelname)s %(name)s: %(message)s")
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    if os.environ.get("OSTINATO_TP_STACK_DUMP_S"):  # debugging a hang: every N s, where each thread waits
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["OSTINATO_TP_STACK_DUMP_S"]), repeat=True)
    # Ctrl-C reaches every process of the terminal's group: rank 0 handles it and stops this rank.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    info = RankInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]), True)
    try:
        import torch.distributed as dist

        args = EngineArgs(**json.loads(os.environ["OSTINATO_TP_ARGS"]))
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), info.world_size,
                              is_master=False, timeout=_timeout())
        store.set(f"ostinato/joined/{info.rank}", "1")  # rank 0 waits for these, watching that we live
        steps = Connection(os.dup(0), writable=False)
        serve_rank(args, info, lambda _group: PipeChannel(reader=steps), store)
    except BaseException as e:  # noqa: BLE001 - any failure is reported to rank 0 with its cause
        cause = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        report.write(json.dumps({"error": cause, "traceback": traceback.format_exc()}) + "\n")
        report.flush()
        logger.error("rank %d failed: %s", info.rank, cause)
        os._exit(1)
    os._exit(0)


def _timeout():
    from datetime import timedelta

    from ostinato.runner.distributed import timeout_seconds

    return timedelta(seconds=timeout_seconds())


def engine_args_json(args: EngineArgs) -> str:
    return json.dumps(asdict(args))


if __name__ == "__main__":
    main()
