"""Where `ostinato bench`'s graph time differs from the graph itself: the same decode step timed four ways.

- synced: `ostinato bench`'s figure. Each step is (copy the rows to the device, replay) between two CUDA
  events, then a host sync: the GPU idles while the host issues the copy and the replay, and that counts.
- queued: N such steps issued back to back, then one sync (what the engine's async scheduling does: the next
  step is launched before the previous one's tokens are read); per step.
- replay only, queued: N replays with the rows already on the device; per step.
- host: the host's own microseconds to issue one copy and one replay (perf_counter, no sync).

    PYTHONPATH=src python3 benchmarks/step/step_gap.py CK [--batches 1 16] [--steps 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ostinato.config import EngineArgs
from ostinato.engine.engine import LLMEngine
from ostinato.tools.bench.decode import time_cuda, rows_loaded, time_cuda_queued


def host_us(fn, steps: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-model-len", type=int, default=1024)
    args = ap.parse_args()
    engine = LLMEngine(EngineArgs(model=args.model, max_model_len=args.max_model_len, gpu_memory_utilization=0.5,
                                  cuda_graph_sizes=tuple(args.batches)))
    runner = engine.runner
    graphs = runner.graphs
    gen = torch.Generator().manual_seed(0)
    print(f"{args.model}: context {args.context}; ms per step, medians of {args.rounds} rounds")
    print("batch | synced (bench) | queued copy+replay | queued replay | host us (copy, replay)")
    with torch.inference_mode():
        for bs in args.batches:
            with rows_loaded(runner, bs, args.context, gen) as batch:
                size = graphs.graph_size(bs)
                step = lambda: (batch.copy_to_device(size), graphs.replay_filled(bs))  # noqa: E731
                copy = lambda: batch.copy_to_device(size)  # noqa: E731
                replay = lambda: graphs.replay_filled(bs)  # noqa: E731
                copy()
                figures = {"synced": [], "queued": [], "replay": [], "host_copy": [], "host_replay": []}
                for _ in range(args.rounds):
                    figures["synced"].append(time_cuda(step, args.steps, 10))
                    figures["queued"].append(time_cuda_queued(step, args.steps, 1, warmup_rounds=0))
                    figures["replay"].append(time_cuda_queued(replay, args.steps, 1, warmup_rounds=0))
                    figures["host_copy"].append(host_us(copy, args.steps))
                    figures["host_replay"].append(host_us(replay, args.steps))
            med = {k: statistics.median(v) for k, v in figures.items()}
            print(f"{bs:5d} | {med['synced']:.4f} | {med['queued']:.4f} | {med['replay']:.4f} | "
                  f"{med['host_copy']:.1f}, {med['host_replay']:.1f}", flush=True)


if __name__ == "__main__":
    main()
