"""`ostinato bench prefix` and `ostinato bench chunked`: what prefix caching and chunked prefill buy, offline.

bench prefix: time to first token (one request alone, max_tokens 1) of a --prompt-len prompt whose first
--cached-len tokens are in the prefix cache, against the same length with nothing cached. Every timed prompt
is new random token ids (a fresh tail after the one shared, warmed prefix), medians of --iters runs after a
warm-up. The goal: cached TTFT <= 20% of uncached at 4,096 tokens with 3,584 cached.

bench chunked: --num-decodes requests decode (prompts of --decode-context tokens, ignore_eos); their
inter-token latency (the time between engine steps that gave a request a token) is measured for --base-steps
steps, then a --prompt-len prompt arrives and is prefilled (in chunks of what --max-num-batched-tokens leaves
beside the decode rows) until its first token. Reported: the decodes' median inter-token latency without the
prefill, their p99 and max while it runs, and the long prompt's TTFT, for each of --rounds long prompts sent
one after another (the first may meet first-time costs; every step's time is in the JSON). The goal:
p99 <= 2x the median at 32 decodes and an 8,192-token prompt. Run it again with --max-num-batched-tokens above
--prompt-len to see one unchunked prefill land in a single gap.

Both drive LLMEngine.step() directly and time it on the host (what a client sees): bench prefix synchronizes
the GPU at each timed event; bench chunked times a token when the engine hands it out, with overlapped
scheduling left running as in the server (a step's `step_ms` in the JSON is host time).
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from dataclasses import replace


def register(sub) -> None:
    from ostinato.cli_args import add_engine_args

    p = sub.add_parser("bench-prefix", help="TTFT of a prompt with a cached prefix vs uncached (prefix caching)")
    add_engine_args(p)
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--cached-len", type=int, default=3584, help="leading tokens already in the prefix cache")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=run_prefix)

    p = sub.add_parser("bench-chunked", help="inter-token latency of running decodes while a long prompt is "
                                             "prefilled (chunked prefill)")
    add_engine_args(p)
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--num-decodes", type=int, default=32)
    p.add_argument("--decode-context", type=int, default=256, help="prompt tokens of each decoding request")
    p.add_argument("--base-steps", type=int, default=64, help="steps timed before the long prompt arrives")
    p.add_argument("--rounds", type=int, default=2,
                   help="long prompts sent one after another; the headline figures are the last (warm) round's")
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=run_chunked)


def _engine(args, min_len: int):
    from ostinato.cli_args import engine_args_from
    from ostinato.engine.engine import LLMEngine

    eargs = engine_args_from(args)
    if eargs.max_model_len is None:
        eargs = replace(eargs, max_model_len=min_len)
    return LLMEngine(eargs)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _ttft(engine, request_id: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds from add_request to the first token of a request alone in the engine; its cached tokens."""
    from ostinato.sampling_params import SamplingParams

    _sync()
    t0 = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    while True:
        outs = [o for o in engine.step() if o.request_id == request_id]
        if outs and outs[-1].outputs and outs[-1].outputs[0].token_ids:
            _sync()
            dt = time.perf_counter() - t0
            while engine.has_unfinished():
                engine.step()
            return dt, outs[-1].num_cached_tokens


def run_prefix(args) -> int:
    from ostinato.errors import ConfigError

    if not 0 <= args.cached_len < args.prompt_len:
        raise ConfigError(f"--cached-len must be in [0, --prompt-len), got {args.cached_len}")
    engine = _engine(args, args.prompt_len + 16)
    if not engine.config.enable_prefix_caching:
        raise ConfigError("bench prefix measures prefix caching: drop --no-enable-prefix-caching")
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    prefix = _random_ids(rng, args.cached_len, vocab)
    block = engine.config.runner.kv_pool.block_size
    _ttft(engine, "warm-uncached", _random_ids(rng, args.prompt_len, vocab))  # warm-up (allocator, kernels)
    _ttft(engine, "warm-prefix", prefix + _random_ids(rng, args.prompt_len - args.cached_len, vocab))
    uncached, cached, hits = [], [], []
    for i in range(args.iters):
        uncached.append(_ttft(engine, f"u{i}", _random_ids(rng, args.prompt_len, vocab))[0])
        dt, n = _ttft(engine, f"c{i}", prefix + _random_ids(rng, args.prompt_len - args.cached_len, vocab))
        cached.append(dt)
        hits.append(n)
    result = {
        "prompt_len": args.prompt_len, "cached_len": args.cached_len, "block_size": block,
        "max_num_batched_tokens": engine.scheduler_config.max_num_batched_tokens,
        "cached_tokens_reported": hits,
        "ttft_uncached_ms": 1e3 * statistics.median(uncached), "ttft_cached_ms": 1e3 * statistics.median(cached),
    }
    result["ratio"] = result["ttft_cached_ms"] / result["ttft_uncached_ms"]
    print(f"TTFT of a {args.prompt_len}-token prompt (median of {args.iters}): uncached "
          f"{result['ttft_uncached_ms']:.1f} ms, with {args.cached_len} tokens cached {result['ttft_cached_ms']:.1f} "
          f"ms ({min(hits)} cached tokens reported) = {100 * result['ratio']:.1f}% (goal <= 20%)")
    _write(args, result)
    return 0


def run_chunked(args) -> int:
    from ostinato.errors import ConfigError
    from ostinato.sampling_params import RequestOutputKind, SamplingParams

    if args.rounds < 1:
        raise ConfigError(f"--rounds must be >= 1 (long prompts to time), got {args.rounds}")

    engine = _engine(args, max(args.prompt_len, args.decode_context) + 2 * args.base_steps + 64)
    max_len = engine.scheduler_config.max_model_len
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    # Long enough to outlast the measurement; aborted at the end.
    decode = SamplingParams(temperature=0.0, max_tokens=max_len - args.decode_context - 1, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    names = [f"d{i}" for i in range(args.num_decodes)]
    for name in names:
        engine.add_request(name, _random_ids(rng, args.decode_context, vocab), decode)
    last: dict[str, float] = {}
    gaps: list[float] = []

    def step() -> list:
        # No device sync here: a token's arrival is when the engine hands it out (it has waited for that
        # step's tokens itself), while the next step may already be running: what a streaming client sees.
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id in last:
                gaps.append(now - last[o.request_id])
            if o.request_id.startswith("d"):
                last[o.request_id] = now
        return outs

    while len(last) < len(names):  # every decode has its first token: all run
        step()
    for _ in range(3):  # settle: the last prompts' chunks are done
        step()
    gaps.clear()
    for _ in range(args.base_steps):
        step()
    base = sorted(gaps)
    median = statistics.median(base)
    rounds = []
    for r in range(args.rounds):  # the first prompt may meet first-time costs (kernel variants); later are warm
        gaps.clear()
        rounds.append(_long_prompt_round(engine, step, gaps, f"long{r}", _random_ids(rng, args.prompt_len, vocab)))
        rounds[-1]["ratio"] = rounds[-1]["itl_p99_ms_during_prefill"] / (1e3 * median)
        for _ in range(3):
            step()
    for name in names:
        engine.abort(name)
    stats = engine.stats()
    result = {
        "num_decodes": args.num_decodes, "prompt_len": args.prompt_len,
        "max_num_batched_tokens": engine.scheduler_config.max_num_batched_tokens,
        "itl_median_ms_without_prefill": 1e3 * median, "rounds": rounds, **rounds[-1],
        "prefill_steps_graph": stats.prefill_steps_graph, "prefill_steps_eager": stats.prefill_steps_eager,
        "prefill_graph_sizes": list(stats.prefill_graph_sizes),
    }
    for r, rr in enumerate(rounds, 1):
        print(f"{args.num_decodes} decodes, inter-token latency: median {1e3 * median:.2f} ms without a prefill; "
              f"round {r} of {len(rounds)}, while a {args.prompt_len}-token prompt is prefilled "
              f"({rr['steps_during_prefill']} steps, --max-num-batched-tokens {result['max_num_batched_tokens']}): "
              f"p99 {rr['itl_p99_ms_during_prefill']:.2f} ms, max {rr['itl_max_ms_during_prefill']:.2f} ms = "
              f"{rr['ratio']:.2f}x the median (goal <= 2x); the long prompt's TTFT {rr['long_prompt_ttft_ms']:.0f} ms")
    print(f"prefill steps: {stats.prefill_steps_graph} graph replays, {stats.prefill_steps_eager} eager "
          f"(captured token counts {list(stats.prefill_graph_sizes) or 'none'})")
    _write(args, result)
    return 0


def _long_prompt_round(engine, step, gaps: list[float], request_id: str, prompt: list[int]) -> dict:
    """Add one long prompt and step until its first token: its TTFT, and the decodes' gaps (`gaps`, filled
    by `step`) meanwhile."""
    from ostinato.sampling_params import SamplingParams

    t0 = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    in_order: list[float] = []
    steps = 0
    while True:
        t_step = time.perf_counter()
        outs = step()
        in_order.append(1e3 * (time.perf_counter() - t_step))
        steps += 1
        if any(o.request_id == request_id and o.outputs and o.outputs[0].token_ids for o in outs):
            break
    ttft = time.perf_counter() - t0
    during = sorted(gaps)
    return {
        "itl_p99_ms_during_prefill": 1e3 * _quantile(during, 0.99), "itl_max_ms_during_prefill": 1e3 * during[-1],
        "long_prompt_ttft_ms": 1e3 * ttft, "steps_during_prefill": steps, "step_ms": in_order,
    }


def _quantile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank quantile of an ascending list (p99 of 100 gaps is the 99th)."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def _write(args, result: dict) -> None:
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
