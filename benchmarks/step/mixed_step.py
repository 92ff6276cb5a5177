"""What a mixed step (running decodes + one prefill chunk) costs, and what makes it cost that.

Times, on an idle engine, eager forwards of hand-built steps (wall ms with a device sync, medians, after two
warm-ups), as a user's step feels them:
  chunk      one prompt's chunk of Q new tokens after C cached ones (design (a): beside the decode replay)
  rows       the decode rows alone as 1-token prefills (B rows at context 256)
  combined   rows + chunk in ONE eager forward (design (b) in runner/runner.py, here without a graph)
  attention  the prefill attention kernel alone for the chunk, one layer, times the number of layers
  replay     the same chunk as a prefill CUDA-graph replay (runner/prefill_graphs.py: the buffers filled and
             copied, then the graph of the smallest captured token count >= Q), "eager" when Q is above the
             largest captured count (--prefill-graph-tokens)
and the decode graph replay at B rows from `ostinato bench` is the other half of design (a).

    PYTHONPATH=src python3 benchmarks/step/mixed_step.py /tmp/ck-llama-3.1-8b [--rows 32] [--chunks 96,224,480,2016]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _timed(fn, iters: int = 5) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> int:
    from ostinato.config import EngineArgs
    from ostinato.contract import ScheduledSeq, SchedulerOutput
    from ostinato.engine.engine import LLMEngine
    from ostinato.runner.inputs import build_prefill_inputs
    from ostinato.sampling_params import SamplingParams

    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--row-context", type=int, default=256)
    p.add_argument("--chunks", default="96,224,480,2016")
    p.add_argument("--contexts", default="0,4096,8000")
    p.add_argument("--prefill-graph-tokens", default=None, help="as the engine flag (default: 16..512)")
    args = p.parse_args()
    engine = LLMEngine(EngineArgs(args.model, max_model_len=8448, max_num_seqs=64, gpu_memory_utilization=0.85,
                                  max_num_batched_tokens=8448, prefill_graph_tokens=args.prefill_graph_tokens))
    runner = engine.runner
    model, bs = runner.model, runner.block_size
    layers = len(model.model.layers)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    next_block = [0]

    def seq(i: int, q: int, cached: int) -> ScheduledSeq:
        n = -(-(cached + q) // bs)
        table = tuple(range(next_block[0], next_block[0] + n))
        next_block[0] += n
        return ScheduledSeq(i, tuple([7] * q), cached, table, params, 0)

    def forward(seqs) -> callable:
        out = SchedulerOutput("prefill", tuple(seqs))
        inp = build_prefill_inputs(out, bs, runner.scratch_block, runner.device)

        def run():
            with torch.inference_mode():
                model(inp.input_ids, inp.positions, inp.meta)
        return run, inp

    graphs = runner.prefill_graphs

    def replay(seqs) -> callable:
        out = SchedulerOutput("prefill", tuple(seqs))
        size = graphs.size_for(out)
        if size is None:
            return None

        def run():
            with torch.inference_mode():
                n, _ = graphs.fill(out.seqs, size)
                graphs.graphs.replay_filled(n)
        return run

    rows = [seq(i, 1, args.row_context - 1) for i in range(args.rows)]
    print(f"model {args.model}, {layers} layers; decode rows: {args.rows} at context {args.row_context}")
    t_rows = _timed(forward(rows)[0])
    print(f"rows alone (eager, 1-token prefills): {t_rows:.2f} ms")
    print(f"prefill graphs: {graphs.captured_sizes or 'none'} tokens, up to {graphs.max_seqs} sequences")
    print("| chunk Q | cached C | chunk ms | chunk replay ms | rows+chunk one forward ms | attention ms (x layers) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for q in (int(x) for x in args.chunks.split(",")):
        for c in (int(x) for x in args.contexts.split(",")):
            c = min(c, 8448 - q - 1)
            next_block[0] = args.rows * (-(-args.row_context // bs))
            chunk = seq(1000, q, c)
            run_chunk, inp = forward([chunk])
            t_chunk = _timed(run_chunk)
            run_replay = replay([chunk])
            t_replay = f"{_timed(run_replay):.2f}" if run_replay is not None else "eager"
            t_both = _timed(forward(rows + [chunk])[0])
            attn = model.model.layers[0].self_attn
            qh = torch.randn(q, attn.num_heads, attn.head_dim, device=runner.device, dtype=runner.dtype)
            t_attn = _timed(lambda: attn.backend.prefill(qh, attn.k_cache, attn.v_cache, inp.meta, attn.scale))
            print(f"| {q} | {c} | {t_chunk:.2f} | {t_replay} | {t_both:.2f} | {t_attn * layers:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
