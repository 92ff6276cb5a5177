"""`ostinato bench engine` and `ostinato bench throughput`: whole engine steps, offline.

bench engine: per batch B, a whole LLMEngine step, from two LLM.generate runs of B prompts of `--context`
tokens (greedy, ignore_eos) that differ only in max_tokens: (t_long - t_short) / (long - short). Beside it,
the forward-only replay of the same batch at the same context (`ostinato bench`'s graph figure: the
copy of the decode rows and one replay), so the Python around the graph shows as their ratio.

bench throughput: nano-vllm's workload: 256 sequences, prompt and output lengths uniform in [100, 1024],
random prompt token ids, temperature 0.6, ignore_eos; output tokens per second of one LLM.generate call
(after a short warm-up run), against the workload's floor (workload_floor_seconds): every decode step reads
the weights once and the K/V of every running sequence, at the measured HBM bandwidth, and the prompts
cost their matmul FLOPs (2 per weight per token, plus causal attention) at the measured 773 TFLOP/s.
"""

from __future__ import annotations

import json
import random
import statistics
import time

from ostinato.runner.memory import kv_token_bytes
from ostinato.tools.bench.ceilings import Ceilings, engine_ceilings


def register(sub) -> None:
    from ostinato.cli_args import int_list, add_engine_args

    p = sub.add_parser("bench-engine", help="whole engine step (LLM.generate) vs forward-only replay")
    add_engine_args(p, offline=True)
    p.add_argument("--batch-sizes", type=int_list, default=(1, 8, 32, 64, 128, 256))
    p.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    p.add_argument("--short", type=int, default=16, help="max_tokens of the short run")
    p.add_argument("--long", type=int, default=144, help="max_tokens of the long run")
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=run_engine)

    p = sub.add_parser("bench-throughput", help="nano-vllm's offline workload: output tokens per second")
    add_engine_args(p, offline=True)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="run the workload this many times in the one process; the median is the figure, the "
                        "spread shows the run-to-run noise")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="PNG path: achieved vs floor output tokens per second")
    p.set_defaults(func=run_throughput)


def workload_floor_seconds(mc, weights_read: int, itemsize: int, prompt_lens: list[int], output_lens: list[int],
                           ceilings: Ceilings, kv_itemsize: int | None = None) -> float:
    """Seconds the workload needs at the device's read bandwidth and matmul rate, with every sequence decoded
    together (the first output token comes from the prefill; sequence s then takes output_lens[s] - 1 decode
    steps). kv_itemsize: bytes a cached K or V value (default itemsize, the model's)."""
    kv_per_token = kv_token_bytes(mc, kv_itemsize or itemsize)
    decode_bytes = 0
    for t in range(max(output_lens, default=1) - 1):
        running = [p + 1 + t for p, o in zip(prompt_lens, output_lens) if o - 1 > t]  # context of each row
        decode_bytes += weights_read + kv_per_token * sum(running)
    matmul_params = weights_read // itemsize
    attention = 2 * mc.num_layers * mc.num_heads * mc.head_dim * sum(p * p for p in prompt_lens)  # QK^T + PV, causal
    prefill_flops = 2 * matmul_params * sum(prompt_lens) + attention
    return decode_bytes / ceilings.read_bytes_per_s + prefill_flops / ceilings.matmul_flops_per_s


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _generate_seconds(llm, prompts, params) -> float:
    _sync()
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    _sync()
    return time.perf_counter() - t0


def run_engine(args) -> int:
    import torch

    from ostinato.cli_args import engine_args_from
    from ostinato.engine.llm import LLM
    from ostinato.sampling_params import SamplingParams
    from ostinato.tools.bench.decode import replay_ms

    llm = LLM.from_engine_args(engine_args_from(args))
    runner = llm.engine.runner
    vocab = runner.model_config.vocab_size
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"graphs: {llm.engine.graph_status}")
    for bs in args.batch_sizes:
        prompts = [[rng.randrange(vocab) for _ in range(args.context)] for _ in range(bs)]
        short = SamplingParams(temperature=0.0, max_tokens=args.short, ignore_eos=True)
        long = SamplingParams(temperature=0.0, max_tokens=args.long, ignore_eos=True)
        _generate_seconds(llm, prompts, short)  # warm-up
        t_short = min(_generate_seconds(llm, prompts, short) for _ in range(2))
        t_long = min(_generate_seconds(llm, prompts, long) for _ in range(2))
        step_ms = (t_long - t_short) / (args.long - args.short) * 1e3
        mid = args.context + (args.short + args.long) // 2
        llm.engine.step()  # an idle step: the runner drops the finished sequences' rows
        with torch.inference_mode():
            eager, graph = replay_ms(runner, bs, mid, gen, iters=50, warmup=10)
        replay = graph if graph is not None else eager
        rows.append({"batch": bs, "context": mid, "engine_step_ms": step_ms, "replay_ms": replay,
                     "ratio": step_ms / replay})
        print(f"bs {bs:>4}  engine step {step_ms:.3f} ms  replay {replay:.3f} ms ({'graph' if graph else 'eager'})"
              f"  engine/replay {step_ms / replay:.3f}", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"model": args.model, "graphs": llm.engine.graph_status, "rows": rows}, f, indent=2)
    return 0


def run_throughput(args) -> int:
    from ostinato.cli_args import engine_args_from
    from ostinato.engine.llm import LLM
    from ostinato.errors import ConfigError
    from ostinato.sampling_params import SamplingParams
    from ostinato.tools.bench.decode import weights_read_per_step

    if args.repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {args.repeats}")
    engine_args = engine_args_from(args)
    ceilings = engine_ceilings(engine_args)  # before the model takes the memory
    llm = LLM.from_engine_args(engine_args)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(args.workload_seed)
    prompts = [[rng.randrange(min(vocab, 10000)) for _ in range(rng.randint(args.min_len, args.max_len))]
               for _ in range(args.num_seqs)]
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True,
                             max_tokens=rng.randint(args.min_len, args.max_len)) for _ in range(args.num_seqs)]
    llm.generate(["warm-up"], SamplingParams(max_tokens=8))
    runs = []
    for repeat in range(args.repeats):
        # A repeat's prompts keep their lengths (so the floor is the same) but not their tokens: the prefix cache
        # would otherwise serve the second run's prompts from the first's KV blocks.
        batch = prompts if repeat == 0 else [[(t + repeat) % min(vocab, 10000) for t in p] for p in prompts]
        runs.append(_generate_seconds(llm, batch, params))
    seconds = statistics.median(runs)
    out_tokens = sum(p.max_tokens for p in params)
    runner = llm.engine.runner
    mc = runner.model_config
    floor_s = workload_floor_seconds(mc, weights_read_per_step(runner), runner.dtype.itemsize,
                                     [len(p) for p in prompts], [p.max_tokens for p in params], ceilings,
                                     kv_itemsize=runner.kv_dtype.itemsize)
    result = {"model": args.model, "num_seqs": args.num_seqs, "output_tokens": out_tokens,
              "prompt_tokens": sum(len(p) for p in prompts), "seconds": seconds,
              "output_tokens_per_s": out_tokens / seconds, "runs_seconds": runs, "floor_seconds": floor_s,
              "floor_output_tokens_per_s": out_tokens / floor_s, "share_of_floor": floor_s / seconds,
              "graphs": llm.engine.graph_status, "ceilings": vars(ceilings),
              "stats": {k: v for k, v in vars(llm.engine.stats()).items() if isinstance(v, (int, float))},
              "kernels_compiled_in_service": list(runner.compile_watch.kernels_in_service)}
    print(f"{out_tokens} output tokens in {seconds:.2f} s: {out_tokens / seconds:.0f} tok/s "
          f"({result['prompt_tokens']} prompt tokens; graphs {llm.engine.graph_status}); floor "
          f"{out_tokens / floor_s:.0f} tok/s: {100 * floor_s / seconds:.0f}% of it (at {ceilings.describe()})")
    if result["kernels_compiled_in_service"]:  # each one stalled the run it fell in (runner/compile_watch.py)
        print(f"Triton compiled {len(result['kernels_compiled_in_service'])} kernels inside live steps: "
              + "; ".join(name.split("[")[0] for name in result["kernels_compiled_in_service"]))
    if len(runs) > 1:
        print(f"{len(runs)} runs, tok/s: " + ", ".join(f"{out_tokens / s:.0f}" for s in runs)
              + f" (median {out_tokens / seconds:.0f}, spread {100 * (max(runs) - min(runs)) / seconds:.1f}%)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        from ostinato.tools.bench.plots import bars

        bars({"ostinato": out_tokens / seconds, "bandwidth/FLOP floor": out_tokens / floor_s}, "output tokens / s",
             f"nano-vllm workload ({args.num_seqs} seqs)\n{args.model}", args.plot)
        print(f"wrote {args.plot}")
    return 0
