"""`ostinato bench`: decode-step latency, graph vs eager vs HF transformers eager, in one run.

For each batch size, B sequences sit at `--context` tokens in the paged cache (random block tables drawn from
the pool); the decode forward (inputs -> logits) is timed with CUDA events, median of `--iters` after warm-up:
- ostinato graph: the engine's decode step without the scheduler: one copy of the persistent decode rows to
  the device and one replay (forward and greedy sampling inside the graph), each step between its own events
  and a host sync, so the host's time to issue it counts; "queued": the same steps issued back to back, as
  the engine's async scheduling runs them, per step;
- ostinato eager: the same decode step launched op by op;
- HF eager: transformers' own model class on the same checkpoint, one-token forward over a DynamicCache.
The floor is (weight bytes + KV bytes read) / the read bandwidth measured on this device when the bench starts
(tools/bench/ceilings.py), so a floor on an H100 is the H100's.
`--penalty-rows N` times each batch size a second time with N of its rows using repetition_penalty: the step
then replays the graphs with the logits processors (runner/decode_step.py), and the two lines show what they
cost against a batch that uses none.
"""

from __future__ import annotations

import contextlib
import json
import statistics


def weights_read_per_step(runner) -> int:
    """Weight bytes a decode step reads, as the model holds them (runner.weights_bytes: quantized projections
    count their blocks and scales, QuantizedLinear.weight_bytes), less an untied embedding table, of which a
    step reads one row per token (a tied table is read whole, as the lm_head): llama-3.1-8b in bf16 reads
    15.01 GB per step, not its 16.06 GB file. FP8 projections count one byte a weight plus their float32 scales,
    GGUF ones their blocks, so the floor is the format's own."""
    mc = runner.model_config
    untied_table = 0 if mc.tie_word_embeddings else mc.vocab_size * mc.hidden_size * runner.dtype.itemsize
    world_size = getattr(getattr(runner, "tp", None), "world_size", 1)  # a rank holds 1/world_size of the table
    return runner.weights_bytes - untied_table // world_size


def has_hf_weights(model_dir) -> bool:
    """Whether transformers can load model_dir as it is: a GGUF file's metadata folder holds no weights."""
    from ostinato.model.gguf_native import is_native_gguf_dir

    return not is_native_gguf_dir(model_dir)


def register(sub) -> None:
    from ostinato.cli_args import int_list, add_engine_args

    p = sub.add_parser("bench", help="decode-step latency: graph vs eager vs HF transformers")
    add_engine_args(p)
    p.add_argument("--batch-sizes", type=int_list, default=(1, 8, 32, 64))
    p.add_argument("--context", type=int, default=512, help="tokens already in each sequence's cache")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    p.add_argument("--penalty-rows", type=int, default=0, metavar="N",
                   help="also time each batch size with N of its rows using repetition_penalty (the decode graphs "
                        "with the logits processors); 0: only without")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="PNG path: latency against batch size, with the floor")
    p.set_defaults(func=run)


def time_cuda(fn, iters: int, warmup: int) -> float:
    """Median milliseconds of fn() measured with CUDA events (CPU wall time on CPU)."""
    import torch

    from ostinato.tools.bench.ceilings import elapsed_ms

    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    return statistics.median(elapsed_ms(fn, cuda) for _ in range(iters))


def join_random_rows(runner, bs: int, context: int, gen, penalty_rows: int = 0) -> list[int]:
    """B sequences join the (empty) persistent decode batch at `context` cached tokens, greedy, over random
    blocks, as prefilled sequences join it, the first `penalty_rows` of them with repetition_penalty; returns
    their seq ids (leave_rows takes them out again)."""
    import torch

    from ostinato.contract import LogitsSpec, ScheduledSeq
    from ostinato.sampling_params import SamplingParams

    block = runner.block_size
    nblk = -(-(context + 1) // block)
    if nblk > runner.decode_batch.layout.blocks_per_seq:
        from ostinato.errors import ConfigError

        longest = runner.decode_batch.layout.blocks_per_seq * block - 1
        raise ConfigError(f"--context {context} does not fit this engine's sequences (at most {longest} cached "
                          f"tokens and the new one): raise --max-model-len above {context} or lower --context")
    total = runner.cache_config.num_blocks
    if bs * nblk <= total:
        perm = torch.randperm(total, generator=gen)[: bs * nblk].view(bs, nblk)
    else:  # rows share blocks: the time depends on the bytes read, not on which blocks
        perm = torch.randint(0, total, (bs, nblk), generator=gen)
    ids = torch.randint(0, runner.model_config.vocab_size, (bs,), generator=gen).tolist()
    batch, greedy = runner.decode_batch, SamplingParams(temperature=0.0, max_tokens=1)
    penalized = SamplingParams(temperature=0.0, max_tokens=1, repetition_penalty=1.1)
    assert not len(batch), "the bench's rows go into an idle engine"
    for i, table in enumerate(perm.tolist()):
        # One token at position context - 1 makes a context of `context`: the row feeds its next token there.
        extra = dict(logits_spec=LogitsSpec(penalized, (), ()), history=(0,)) if i < penalty_rows else {}
        seq = ScheduledSeq(i, (0,), context - 1, tuple(table), penalized if extra else greedy, 0, **extra)
        batch.join(seq, first_token=ids[i])
    return list(range(bs))


def leave_rows(runner, seq_ids: list[int]) -> None:
    """The bench's sequences leave (last row first: nothing moves), and every row is padding again, on the
    device too."""
    batch = runner.decode_batch
    for seq_id in reversed(seq_ids):
        batch.leave(seq_id)
    batch.reset()


@contextlib.contextmanager
def rows_loaded(runner, bs: int, context: int, gen, penalty_rows: int = 0):
    """The decode batch holds `bs` random rows at `context` cached tokens (join_random_rows) inside the block;
    after it, the rows go back to padding, on the device too."""
    seq_ids = join_random_rows(runner, bs, context, gen, penalty_rows)
    try:
        yield runner.decode_batch
    finally:
        leave_rows(runner, seq_ids)


def time_cuda_queued(fn, iters: int, rounds: int, warmup_rounds: int = 1) -> float:
    """Median milliseconds per fn() over `rounds` rounds of `iters` calls issued back to back between two CUDA
    events and one sync (after `warmup_rounds` such rounds untimed)."""
    import torch

    times = []
    for _ in range(warmup_rounds + rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times[warmup_rounds:])


def _seed(gen) -> int:
    import torch

    return int(torch.randint(0, 2**31 - 1, (1,), generator=gen))


def replay_ms(runner, bs: int, context: int, gen, iters: int, warmup: int, penalty_rows: int = 0
              ) -> tuple[float, float | None]:
    """(eager, graph) milliseconds of one decode step (forward and in-graph sampling) on the engine's own
    decode rows: the copy of the rows to the device plus the replay, as LLMEngine.step makes them. Graph is
    None above the largest captured size or with graphs off. Every rank times the same steps (under tensor
    parallelism their collectives pair up); rank 0's times are returned."""
    return runner.call_all(f"{__name__}:replay_ms_seeded", bs, context, _seed(gen), iters, warmup, penalty_rows)


def replay_ms_seeded(runner, bs: int, context: int, seed: int, iters: int, warmup: int, penalty_rows: int = 0):
    """replay_ms on one rank's runner, its random rows drawn from `seed`: what each rank runs."""
    import torch

    with rows_loaded(runner, bs, context, torch.Generator().manual_seed(seed), penalty_rows) as batch:
        rows = batch.copy_to_device(bs)
        eager_ms = time_cuda(lambda: runner.decode_step(rows), iters, warmup)
        graph_ms, graphs = None, runner.step_graphs()  # the set the loaded rows replay
        size = graphs.graph_size(bs)
        if size is not None:
            graph_ms = time_cuda(lambda: (batch.copy_to_device(size), graphs.replay_filled(bs)), iters, warmup)
    return eager_ms, graph_ms


def queued_graph_ms(runner, bs: int, context: int, gen, iters: int, rounds: int = 5, penalty_rows: int = 0
                    ) -> float | None:
    """Milliseconds per graph step when steps are issued back to back: `iters` times (copy the rows, replay)
    between two CUDA events and one sync, median of `rounds`. The engine runs decode steps that way (async
    scheduling launches step n+1 before it reads step n's tokens), so the host's time to issue a step hides
    behind the step before; replay_ms's synced figure counts it (tens of microseconds at batch 1,
    benchmarks/step/step_gap.py). None where there is no graph for bs; CUDA only."""
    return runner.call_all(f"{__name__}:queued_graph_ms_seeded", bs, context, _seed(gen), iters, rounds,
                           penalty_rows)


def queued_graph_ms_seeded(runner, bs: int, context: int, seed: int, iters: int, rounds: int, penalty_rows: int = 0):
    """queued_graph_ms on one rank's runner, its rows drawn from `seed`: what each rank runs."""
    import torch

    if not torch.cuda.is_available():
        return None
    with rows_loaded(runner, bs, context, torch.Generator().manual_seed(seed), penalty_rows) as batch:
        size = runner.step_graphs().graph_size(bs)  # the set the loaded rows replay
        if size is None:
            return None
        graphs = runner.step_graphs()
        return time_cuda_queued(lambda: (batch.copy_to_device(size), graphs.replay_filled(bs)), iters, rounds)


def load_hf(model_dir: str, dtype, device):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def hf_step_ms(hf, device, bs: int, context: int, iters: int, warmup: int, vocab: int) -> float:
    """transformers' own decode step: a one-token forward over a DynamicCache already holding `context`."""
    import torch
    from transformers import DynamicCache

    with torch.inference_mode():
        ids = torch.randint(0, vocab, (bs, context), device=device)
        cache = DynamicCache()
        hf(input_ids=ids, past_key_values=cache, use_cache=True)
        tok = torch.randint(0, vocab, (bs, 1), device=device)

        def step():
            hf(input_ids=tok, past_key_values=cache, use_cache=True)

        # The cache grows by one token per call: warm-up + iters tokens past `context` (a few %).
        return time_cuda(step, iters, warmup)


def measure_row(runner, args, bs: int, penalty_rows: int, gen, hf, weights: int, kv_bytes_per_token: int,
                read_bytes_per_s: float) -> dict:
    """One batch size's figures (`penalty_rows` of its rows with repetition_penalty), printed as one line."""
    eager_ms, graph_ms = replay_ms(runner, bs, args.context, gen, args.iters, args.warmup, penalty_rows)
    queued_ms = queued_graph_ms(runner, bs, args.context, gen, args.iters, penalty_rows=penalty_rows)
    floor_ms = (weights + bs * (args.context + 1) * kv_bytes_per_token) / read_bytes_per_s * 1e3
    hf_ms = None
    if hf is not None and not penalty_rows:
        hf_ms = hf_step_ms(hf, runner.device, bs, args.context, args.iters, args.warmup,
                           runner.model_config.vocab_size)
    best = graph_ms or eager_ms
    r = {
        "batch": bs, "penalty_rows": penalty_rows, "context": args.context, "graph_ms": graph_ms,
        "graph_queued_ms": queued_ms, "eager_ms": eager_ms, "hf_ms": hf_ms,
        "floor_ms": floor_ms, "graph_speedup_vs_eager": eager_ms / graph_ms if graph_ms else None,
        "floor_ratio_queued": floor_ms / queued_ms if queued_ms else None,
        "speedup_vs_hf": hf_ms / best if hf_ms else None, "floor_ratio": floor_ms / best,
        "achieved_GBps": (weights + bs * (args.context + 1) * kv_bytes_per_token) / best / 1e6,
    }
    fmt = lambda v, f="{:.3f}": "-" if v is None else f.format(v)  # noqa: E731
    penalized = f" ({penalty_rows} with repetition_penalty)" if penalty_rows else ""
    print(f"bs {bs:>4}{penalized}  graph {fmt(graph_ms)} ms (queued {fmt(queued_ms)})  eager {fmt(eager_ms)} ms  "
          f"HF {fmt(hf_ms)} ms  "
          f"floor {floor_ms:.3f} ms  graph/eager x{fmt(r['graph_speedup_vs_eager'], '{:.2f}')}  "
          f"vs HF x{fmt(r['speedup_vs_hf'], '{:.2f}')}  floor/achieved {r['floor_ratio']:.2f}  "
          f"{r['achieved_GBps']:.0f} GB/s")
    return r


def run(args) -> int:
    import torch

    from ostinato.cli_args import engine_args_from
    from ostinato.config import quantization_label
    from ostinato.engine.engine import LLMEngine
    from ostinato.errors import ConfigError
    from ostinato.runner.memory import kv_token_bytes
    from ostinato.tools.bench.ceilings import engine_ceilings

    if args.penalty_rows < 0:
        raise ConfigError(f"--penalty-rows must be >= 0 (rows of each batch that use repetition_penalty), got "
                          f"{args.penalty_rows}")
    engine_args = engine_args_from(args)
    ceilings = engine_ceilings(engine_args)  # before the model takes the memory
    engine = LLMEngine(engine_args)
    runner = engine.runner
    weights = weights_read_per_step(runner)
    mc = runner.model_config
    kv_bytes_per_token = kv_token_bytes(mc, runner.kv_dtype.itemsize)
    gen = torch.Generator().manual_seed(0)
    rows = []
    if not args.no_hf and not has_hf_weights(engine.model_dir):
        print("no HF baseline: a GGUF file run in its blocks (bench it with --gguf-dequantize for one)")
    hf = None if args.no_hf or not has_hf_weights(engine.model_dir) else load_hf(engine.model_dir, runner.dtype,
                                                                                 runner.device)
    print(f"model {args.model}: {runner.weights_bytes / 1e9:.2f} GB weights ({weights / 1e9:.2f} GB read per step), "
          f"{runner.dtype}, weights {quantization_label(mc.quantization)}, KV cache {runner.kv_dtype}, "
          f"graphs: {engine.graph_status}")
    print(f"floors: bytes read over {ceilings.describe()}")
    with torch.inference_mode():
        for bs in args.batch_sizes:
            for penalty_rows in dict.fromkeys((0, min(args.penalty_rows, bs))):
                rows.append(measure_row(runner, args, bs, penalty_rows, gen, hf, weights, kv_bytes_per_token,
                                        ceilings.read_bytes_per_s))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"model": args.model, "dtype": str(runner.dtype), "torch": torch.__version__,
                       "quantization": quantization_label(mc.quantization), "kv_cache_dtype": str(runner.kv_dtype),
                       "weights_read_bytes": weights,
                       "device": ceilings.device, "read_bytes_per_s": ceilings.read_bytes_per_s,
                       "graph_status": engine.graph_status, "rows": rows}, f, indent=2)
    if args.plot:
        from ostinato.tools.bench.plots import latency_vs_batch

        rows = [r for r in rows if not r["penalty_rows"]]
        series = {"ostinato graph": [r["graph_ms"] for r in rows], "ostinato eager": [r["eager_ms"] for r in rows]}
        if hf is not None:
            series["HF eager"] = [r["hf_ms"] for r in rows]
        latency_vs_batch([r["batch"] for r in rows], series, [r["floor_ms"] for r in rows],
                         f"decode step, context {args.context}\n{args.model}", args.plot)
        print(f"wrote {args.plot}")
    return 0
