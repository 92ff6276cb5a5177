"""Programmatic dependent launch on and off, in one process: the same decode step (forward and in-graph
sampling, DecodeStep) captured twice per batch size, once with the Triton kernels launched plainly and once
with PDL (kernels/pdl.py), replayed alternately so that clocks and process-to-process noise hit both alike.

--cublas-wide adds a third graph: PDL on, but the wide projections at batch 1 (gate_up of Llama-3.2-1B and
-3.1-8B) on cuBLAS, as the tile rule has them without PDL (kernels/gemv.py, choose_gemv_tiles).

Also checks that the graphs give the same logits, bit for bit, on the same inputs (PDL changes when a
kernel starts, never what it computes; a missing wait would show here as a race).

    PYTHONPATH=src python3 benchmarks/step/pdl.py /tmp/ck-qwen3-0.6b --batches 1 8 64 --context 512
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

from ostinato.config import EngineArgs
from ostinato.engine.engine import LLMEngine
from ostinato.kernels import gemv
from ostinato.kernels.fused import kernels_for
from ostinato.tools.bench.decode import join_random_rows, leave_rows


def set_pdl(runner, on: bool) -> None:
    """Switch the decoder's kernel set and the attention backend's launch setting (before a capture)."""
    backend = runner.backend
    backend.tuning = dataclasses.replace(backend.tuning, decode=dataclasses.replace(backend.tuning.decode, pdl=on))
    backend.pdl = on
    runner.model.kernels = kernels_for(runner.device, on)


RULE = gemv.choose_gemv_tiles


def rule_without_pdl(m: int, n: int, k: int, pdl: bool = False):
    return RULE(m, n, k, False)


def capture(step, rows) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step(rows)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(rows)
    return graph, out


def time_replays(graph, replays: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--cublas-wide", action="store_true")
    args = ap.parse_args()
    engine = LLMEngine(EngineArgs(model=args.model, max_model_len=args.max_model_len, enforce_eager=True,
                                  gpu_memory_utilization=args.gpu_memory_utilization, pdl="on"))
    runner = engine.runner
    gen = torch.Generator().manual_seed(0)
    print(f"{args.model}: context {args.context}, {args.rounds} rounds x {args.replays} replays, ms per step")
    with torch.inference_mode():
        for bs in args.batches:
            batch = runner.decode_batch
            seq_ids = join_random_rows(runner, bs, args.context, gen)
            rows = batch.copy_to_device(bs)
            graphs = {}
            for on in (False, True):
                set_pdl(runner, on)
                graphs[on] = capture(runner.decode_step, rows)
            if args.cublas_wide:
                gemv.choose_gemv_tiles = rule_without_pdl
                graphs["cublas"] = capture(runner.decode_step, rows)
                gemv.choose_gemv_tiles = RULE
            outs = {}
            for key in graphs:
                graphs[key][0].replay()
                torch.cuda.synchronize()
                outs[key] = graphs[key][1].clone()
            same = torch.equal(outs[False], outs[True])
            times = {key: [] for key in graphs}
            for _ in range(args.rounds):
                for key in graphs:
                    times[key].append(time_replays(graphs[key][0], args.replays))
            off, on = statistics.median(times[False]), statistics.median(times[True])
            print(f"bs {bs:>4}  pdl off {off:.4f}  pdl on {on:.4f}  on/off {on / off:.3f}  "
                  f"(spread off {min(times[False]):.4f}-{max(times[False]):.4f}, "
                  f"on {min(times[True]):.4f}-{max(times[True]):.4f})  logits bit-identical: {same}")
            if args.cublas_wide:
                cublas = statistics.median(times["cublas"])
                err = ((outs["cublas"] - outs[True]).abs().max() / outs[True].abs().max()).item()
                print(f"          pdl on, wide projections on cuBLAS {cublas:.4f}  on/this {on / cublas:.3f}  "
                      f"max rel. logit difference {err:.1e}")
            del graphs
            leave_rows(runner, seq_ids)


if __name__ == "__main__":
    main()
