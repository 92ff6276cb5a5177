"""`ostinato bench peers MODEL`: ostinato's decode step against HF transformers on the same weights, one run.

Batch 1, `--context` tokens already cached, CUDA-event medians after warm-up:
- ostinato graph: the copy of the decode rows plus one replay (forward and greedy sampling), as `bench`;
- HF eager: transformers' model class, a one-token forward over a DynamicCache;
- HF compiled: the same model with a StaticCache and torch.compile(mode="reduce-overhead", fullgraph=True)
  on a one-token step function, called in a plain loop with torch.compiler.cudagraph_mark_step_begin()
  before each step and the logits cloned (the recipe that works on transformers 5.17 + torch 2.11;
  model.generate(cache_implementation="static") crashed there). Its compile time (the first
  calls, until the graph is recorded) is reported.
The floor is the weights read once per token plus the KV of the context, at the measured HBM bandwidth.
Writes a JSON report and a PNG bar chart (`--output-json`, `--plot`).
"""

from __future__ import annotations

import json
import time

from ostinato.runner.memory import kv_token_bytes
from ostinato.tools.bench.ceilings import engine_ceilings
from ostinato.tools.bench.decode import hf_step_ms, load_hf, time_cuda, replay_ms, weights_read_per_step


def register(sub) -> None:
    from ostinato.cli_args import add_engine_args

    p = sub.add_parser("bench-peers", help="decode step at batch 1: ostinato vs HF eager vs HF static+compile")
    add_engine_args(p)
    p.add_argument("--context", type=int, default=512, help="tokens already in the cache")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--no-compile", action="store_true", help="skip HF + torch.compile (it compiles 20-80 s)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="PNG path for the bar chart")
    p.set_defaults(func=run)


def hf_compiled_ms(hf, device, context: int, iters: int, warmup: int, vocab: int) -> tuple[float, float]:
    """(ms per step, compile seconds) of HF + StaticCache + torch.compile(reduce-overhead) at batch 1."""
    import torch
    from transformers import StaticCache

    cache = StaticCache(config=hf.config, max_cache_len=context + warmup + iters + 16)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():  # not inference_mode: its tensors cannot enter the compiled graph's cudagraph
        ids = torch.randint(0, vocab, (1, context), device=device, generator=gen)
        hf(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(context, device=device))

        def one_token(tok, pos):
            return hf(input_ids=tok, past_key_values=cache, use_cache=True, cache_position=pos).logits

        compiled = torch.compile(one_token, mode="reduce-overhead", fullgraph=True)
        tok = torch.randint(0, vocab, (1, 1), device=device, generator=gen)
        position = [context]

        def step():
            torch.compiler.cudagraph_mark_step_begin()
            pos = torch.tensor([position[0]], device=device)
            position[0] += 1
            return compiled(tok, pos).clone()

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):  # compile, then cudagraph warm-up and recording
            step()
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        return time_cuda(step, iters, warmup), compile_s


def run(args) -> int:
    import torch

    from ostinato.cli_args import engine_args_from
    from ostinato.engine.engine import LLMEngine
    from ostinato.tools.bench import plots as bench_plots

    engine_args = engine_args_from(args)
    ceilings = engine_ceilings(engine_args)  # before the model takes the memory
    engine = LLMEngine(engine_args)
    runner = engine.runner
    mc = runner.model_config
    gen = torch.Generator().manual_seed(0)
    kv_bytes = kv_token_bytes(mc, runner.kv_dtype.itemsize) * (args.context + 1)
    floor_ms = (weights_read_per_step(runner) + kv_bytes) / ceilings.read_bytes_per_s * 1e3
    result: dict = {"model": args.model, "context": args.context, "batch": 1, "dtype": str(runner.dtype),
                    "torch": torch.__version__, "graph_status": engine.graph_status, "floor_ms": floor_ms,
                    "device": ceilings.device, "read_bytes_per_s": ceilings.read_bytes_per_s}
    with torch.inference_mode():
        eager_ms, graph_ms = replay_ms(runner, 1, args.context, gen, args.iters, args.warmup)
    result["ostinato_ms"] = graph_ms or eager_ms
    hf = load_hf(engine.model_dir, runner.dtype, runner.device)
    result["hf_eager_ms"] = hf_step_ms(hf, runner.device, 1, args.context, args.iters, args.warmup, mc.vocab_size)
    result["hf_compiled_ms"] = result["hf_compile_s"] = result["hf_compiled_error"] = None
    if not args.no_compile:
        try:
            result["hf_compiled_ms"], result["hf_compile_s"] = hf_compiled_ms(
                hf, runner.device, args.context, args.iters, args.warmup, mc.vocab_size)
        except Exception as exc:  # a peer's failure is a result to report, not a reason to lose the others
            result["hf_compiled_error"] = f"{type(exc).__name__}: {exc}"[:500]
    ours = result["ostinato_ms"]
    result["speedup_vs_hf_eager"] = result["hf_eager_ms"] / ours
    result["speedup_vs_hf_compiled"] = result["hf_compiled_ms"] / ours if result["hf_compiled_ms"] else None
    print(f"batch 1, context {args.context}: ostinato {ours:.3f} ms, HF eager {result['hf_eager_ms']:.3f} ms "
          f"(x{result['speedup_vs_hf_eager']:.2f}), floor {floor_ms:.3f} ms")
    if result["hf_compiled_ms"]:
        print(f"HF static cache + torch.compile(reduce-overhead): {result['hf_compiled_ms']:.3f} ms "
              f"(ostinato x{result['speedup_vs_hf_compiled']:.2f} faster), compiled in {result['hf_compile_s']:.1f} s")
    elif result["hf_compiled_error"]:
        print(f"HF static cache + torch.compile failed: {result['hf_compiled_error']}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        bench_plots.bars({"ostinato (graph)": ours, "HF eager": result["hf_eager_ms"],
                          "HF static+compile": result["hf_compiled_ms"]}, "ms per token (batch 1)",
                         f"decode step, context {args.context}\n{args.model}", args.plot, floor=floor_ms, log=True)
        print(f"wrote {args.plot}")
    return 0

