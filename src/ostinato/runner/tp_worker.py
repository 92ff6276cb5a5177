"""A tensor-parallel worker rank (ranks 1..N-1): build the same ModelRunner as rank 0, then run every
message rank 0 sends until it says stop.

Messages (runner/distributed.py carries them): ("step", SchedulerOutput) runs a step exactly as rank 0
does (its tokens are dropped: rank 0 returns them); ("call", "module:function", args) runs
function(runner, *args) on every rank (bench, verify); ("stop",) ends the loop.

Started two ways: by rank 0 (runner/tp_executor.py) as `python -m ostinato.runner.tp_worker`, with rank 0's
RunnerConfig in $OSTINATO_TP_CONFIG, steps on stdin and failures reported as one JSON line on stdout; or by
the user's own command under torchrun (cli.py / LLM call `run_worker` when RANK > 0).
"""

from __future__ import annotations

import base64
import importlib
import json
import logging
import os
import pickle
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from ostinato.config import RunnerConfig
from ostinato.runner.distributed import BroadcastChannel, PipeChannel, RankInfo, agree_min, init_group

logger = logging.getLogger(__name__)


def resolve_call(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def serve_rank(config: RunnerConfig, info: RankInfo, channel_for, store: Any = None) -> None:
    """Build this rank's runner and run rank 0's messages until ("stop",). channel_for(cpu_group) -> channel."""
    from ostinato.runner.runner import ModelRunner, pick_device

    tp, cpu_group = init_group(info, pick_device(config.device).type, store)
    runner = ModelRunner(config, tp, lambda n: agree_min(n, cpu_group))
    channel = channel_for(cpu_group)
    while True:
        message = channel.recv()
        if message[0] == "stop":
            break
        if message[0] == "step":
            runner.launch(message[1])  # rank 0 reads the tokens; this rank's copy of them is not needed
        elif message[0] == "call":
            import torch

            with torch.inference_mode():  # as rank 0's callers (bench, verify) run them
                resolve_call(message[1])(runner, *message[2])


def run_worker(config: RunnerConfig, info: RankInfo) -> None:
    """A torchrun-style worker: steps come over a gloo broadcast from rank 0.

    The group this function created is destroyed here, in order, while rank 0 may still host the store; a group
    the user set up before (torchrun scripts may) is theirs to keep. That alone did not stop the process from
    aborting in torch's teardown after its last line now and then, so the callers end it by
    distributed.leave_process."""
    import torch.distributed as dist

    owns_group = not dist.is_initialized()
    serve_rank(config, info, lambda cpu_group: BroadcastChannel(cpu_group, info.rank))
    if owns_group and dist.is_initialized():
        dist.destroy_process_group()


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

        config = runner_config_from_env()
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), info.world_size,
                              is_master=False, timeout=_timeout())
        store.set(f"ostinato/joined/{info.rank}", "1")  # rank 0 waits for these, watching that we live
        steps = Connection(os.dup(0), writable=False)
        serve_rank(config, info, lambda _group: PipeChannel(reader=steps), store)
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


CONFIG_ENV = "OSTINATO_TP_CONFIG"  # the RunnerConfig rank 0 resolved, pickled: every rank builds the same runner


def runner_config_env(config: RunnerConfig) -> str:
    return base64.b64encode(pickle.dumps(config)).decode("ascii")


def runner_config_from_env() -> RunnerConfig:
    return pickle.loads(base64.b64decode(os.environ[CONFIG_ENV]))


if __name__ == "__main__":
    main()
