"""Tensor-parallel probe: does this host's NCCL work, eagerly and inside a CUDA graph, without the engine?

    PYTHONPATH=src python3 -m ostinato.tools.tp_probe [--world-size 2]

Each rank prints every stage as it reaches it (flushed), so a hang shows where it stopped:
init (NCCL group, bound to its GPU), eager all-reduce, all-reduce captured in a CUDA graph
(capture_error_mode "thread_local", as the decode graphs under tensor parallelism use), and ten replays,
each checked against the expected sum. Exit code 0 when every rank finished every stage.
Why: a TP run that hangs inside the engine tests shows nothing of where; this checks NCCL apart from the engine.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta


def _rank(rank: int, world: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    def say(stage: str) -> None:
        print(f"[rank {rank}] {stage}", flush=True)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timedelta(seconds=60),
                            device_id=torch.device("cuda", rank))
    say("init done")
    x = torch.full((4096,), float(rank + 1), device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    expected = world * (world + 1) / 2
    assert x[0].item() == expected, (x[0].item(), expected)
    say("eager all-reduce ok")
    static = torch.zeros(4096, device="cuda")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on the side stream, as graph capture wants
        y = static + 1
        dist.all_reduce(y)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        y = static + 1
        dist.all_reduce(y)
    say("captured")
    for i in range(10):
        static.fill_(float(rank + i))
        graph.replay()
        torch.cuda.synchronize()
        want = sum(r + i + 1 for r in range(world))
        assert y[0].item() == want, (i, y[0].item(), want)
    say("10 replays ok")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    import socket

    import torch
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    args = p.parse_args(argv)
    if torch.cuda.device_count() < args.world_size:
        print(f"needs {args.world_size} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(args.world_size, port), nprocs=args.world_size, join=True)
    print("probe: every rank passed every stage", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
