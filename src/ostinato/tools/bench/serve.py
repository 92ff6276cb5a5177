"""`ostinato bench serve`: load-test a running OpenAI-compatible server and report serving latency.

Sends `--num-prompts` streaming /v1/completions requests (at most `--max-concurrency` in flight, arriving
as a Poisson process at `--request-rate` per second, or all at once with `inf`) with prompts of
`--input-len` tokens and `ignore_eos` outputs of exactly `--output-len` tokens, then reports, like vLLM's
benchmark_serving:

- TTFT: request sent -> first streamed chunk of tokens;
- TPOT: (end-to-end - TTFT) / (output tokens - 1), per request;
- ITL: the gaps between successive chunks (one chunk may carry several tokens if the client fell behind);
- E2EL: request sent -> last byte;
- request and output-token throughput over the whole run, and output tokens per chunk (above 1: the server
  merged tokens that queued while the client, or the server's own streaming, fell behind).

Prompts are random token ids (exact lengths, any model: ids are drawn from `--token-id-range`, which every
supported vocabulary contains) or random English words (`--dataset random-text`, about one token a word).
Works against ostinato or vLLM alike, over plain http (tools/bench/sse_client.py: a client that costs less CPU per
streamed chunk than the server it measures).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ostinato.tools.bench.sse_client import Connection, HTTPStatusError

_WORDS = ("the of and to in is was for on that with as by at from his her an were are which this be or has had "
          "not but first one their its new after who they have she two been other when there all during into "
          "school time may years more most only over city some world would where later up such used many can "
          "state about national out known university united then made").split()


@dataclass(frozen=True)
class BenchConfig:
    base_url: str
    model: str | None = None  # None: the first model /v1/models lists
    num_prompts: int = 64
    max_concurrency: int | None = None  # None: no limit
    request_rate: float = float("inf")  # requests per second; inf sends everything at once
    input_len: int = 128
    output_len: int = 128
    dataset: str = "random-ids"  # random-ids | random-text
    token_id_range: tuple[int, int] = (100, 500)
    seed: int = 0
    api_key: str | None = None
    timeout_s: float = 600.0
    num_warmups: int = 1


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def make_prompts(cfg: BenchConfig) -> list[str | list[int]]:
    rng = random.Random(cfg.seed)
    if cfg.dataset == "random-ids":
        low, high = cfg.token_id_range
        return [[rng.randrange(low, high) for _ in range(cfg.input_len)] for _ in range(cfg.num_prompts)]
    if cfg.dataset == "random-text":
        return [" ".join(rng.choice(_WORDS) for _ in range(cfg.input_len)) for _ in range(cfg.num_prompts)]
    raise ValueError(f"--dataset must be random-ids or random-text, got {cfg.dataset!r}")


# How a streamed chunk with tokens and no usage ends, and how its choices begin, as compact JSON writes them
# (ostinato's chunks; a server that writes otherwise gets every chunk parsed).
_NO_USAGE, _A_CHOICE = b'"usage":null}', b'"choices":[{'


async def _one_request(conn: Connection, cfg: BenchConfig, model: str, prompt: str | list[int]) -> RequestResult:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": cfg.output_len, "temperature": 0.0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
    result = RequestResult(ok=False, prompt_len=len(prompt) if isinstance(prompt, list) else 0)
    start = time.perf_counter()
    last = start

    def on_event(event: bytes, now: float) -> None:
        nonlocal last
        if not event.startswith(b"data: ") or event == b"data: [DONE]" or result.error:
            return
        # Any chunk with choices is new tokens (its text may be empty: a special token, or bytes of a character
        # not yet complete). A compact chunk that ends without usage and has a choice needs no JSON parsing.
        if not (event.endswith(_NO_USAGE) and _A_CHOICE in event):
            chunk = json.loads(event[6:])
            if "error" in chunk:
                result.error = chunk["error"].get("message", "stream error")
                return
            if chunk.get("usage"):
                result.output_tokens = chunk["usage"]["completion_tokens"]
                result.prompt_len = chunk["usage"]["prompt_tokens"]
            if not chunk.get("choices"):
                return
        if result.ttft == 0.0:
            result.ttft = now - start
        else:
            result.itl.append(now - last)
        last = now

    try:
        status, answer = await conn.request("POST", "/v1/completions", body, on_event, timeout=cfg.timeout_s)
        if status != 200:
            result.error = f"HTTP {status}: {answer.decode(errors='replace')[:200]}"
            return result
        if result.error:
            return result
        result.latency = time.perf_counter() - start
        result.ok = result.ttft > 0.0
        if not result.ok:
            result.error = "the stream carried no tokens"
    except Exception as e:  # a benchmark reports failures, it does not stop at the first one
        result.error = f"{type(e).__name__}: {e}"
    return result


def _summary(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {"mean": statistics.fmean(values) * scale, "median": statistics.median(values) * scale, "p99": p99 * scale}


def summarize(cfg: BenchConfig, results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.prompt_len for r in done)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return {
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items() if k != "api_key"},
        "duration_s": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        # Chunks with tokens: fewer than tokens when the server merges a step's backlog (a client or server
        # falling behind), so tokens per chunk above 1 says someone is behind.
        "total_output_chunks": sum(len(r.itl) + 1 for r in done),
        "request_throughput": len(done) / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration > 0 else 0.0,
        "ttft_ms": _summary([r.ttft for r in done]),
        "tpot_ms": _summary(tpot),
        "itl_ms": _summary([gap for r in done for gap in r.itl]),
        "e2el_ms": _summary([r.latency for r in done]),
    }


async def run_benchmark(cfg: BenchConfig, progress: bool = False) -> dict:
    """Run the load test against cfg.base_url and return the summary (the --output-json content).
    progress: a bar of finished requests on stderr (a long run is not silent until its table)."""
    from tqdm import tqdm

    prompts = make_prompts(cfg)
    headers = {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limit = cfg.max_concurrency or cfg.num_prompts
    # One connection per request in flight (tools/bench/sse_client.py says why not httpx).
    conns = [Connection(cfg.base_url, headers) for _ in range(limit)]
    bar = tqdm(total=len(prompts), desc="bench serve", unit="req", disable=not progress)
    try:
        model = cfg.model
        if model is None:
            status, answer = await conns[0].request("GET", "/v1/models", timeout=cfg.timeout_s)
            if status != 200:
                raise HTTPStatusError(status, answer)
            model = json.loads(answer)["data"][0]["id"]
        for prompt in prompts[: cfg.num_warmups]:
            warm = await _one_request(conns[0], cfg, model, prompt)
            if not warm.ok:
                raise RuntimeError(f"the warm-up request failed: {warm.error}")

        idle: asyncio.Queue = asyncio.Queue()  # at most `limit` requests in flight: one per idle connection
        for conn in conns:
            idle.put_nowait(conn)
        rng = random.Random(cfg.seed + 1)

        async def gated(prompt) -> RequestResult:
            conn = await idle.get()
            try:
                return await _one_request(conn, cfg, model, prompt)
            finally:
                idle.put_nowait(conn)
                bar.update(1)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(gated(prompt)))
            if cfg.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    finally:
        bar.close()
        for conn in conns:
            conn.close()
    summary = summarize(cfg, list(results), duration)
    summary["model"] = model
    return summary


def format_table(summary: dict) -> str:
    rows = [
        ("Successful requests", f"{summary['completed']}"),
        ("Failed requests", f"{summary['failed']}"),
        ("Benchmark duration (s)", f"{summary['duration_s']:.2f}"),
        ("Total input tokens", f"{summary['total_input_tokens']}"),
        ("Total generated tokens", f"{summary['total_output_tokens']}"),
        ("Output tokens per chunk", f"{summary['total_output_tokens'] / max(summary['total_output_chunks'], 1):.2f}"),
        ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{summary['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{summary['total_token_throughput']:.2f}"),
    ]
    for key, title in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2EL")):
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {title} (ms)", f"{summary[key][stat]:.2f}"))
    width = max(len(name) for name, _ in rows)
    lines = [f"{'=' * 16} Serving Benchmark Result {'=' * 16}"]
    lines += [f"{name:<{width}}  {value:>12}" for name, value in rows]
    lines += [f"  errors: {e}" for e in summary.get("errors", [])]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server address (http, without /v1)")
    p.add_argument("--model", help="model name to send (default: the first one /v1/models lists)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, help="most requests in flight (default: all)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrival rate in requests/s (default: inf, all at once)")
    p.add_argument("--input-len", type=int, default=128, help="prompt length (tokens, or words for random-text)")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens per request (EOS is ignored)")
    p.add_argument("--dataset", choices=["random-ids", "random-text"], default="random-ids")
    p.add_argument("--token-id-range", type=int, nargs=2, default=(100, 500), metavar=("LOW", "HIGH"),
                   help="random-ids draws prompt token ids from [LOW, HIGH)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' (default: $OSTINATO_API_KEY)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--num-warmups", type=int, default=1, help="requests sent (and not counted) before the run")
    p.add_argument("--output-json", type=Path, help="write the summary here")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar of finished requests on stderr")


def register(subparsers) -> argparse.ArgumentParser:
    """Add `ostinato bench serve` to the CLI (parsed as `bench-serve`, which cli.main maps it to)."""
    p = subparsers.add_parser("bench-serve", prog="ostinato bench serve",
                              help="load-test a running server: TTFT, TPOT, ITL, throughput",
                              description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def run(ns: argparse.Namespace) -> int:
    import os

    if ns.num_prompts < 1 or ns.input_len < 1 or ns.output_len < 1:
        print("error: --num-prompts, --input-len and --output-len must be >= 1")
        return 2
    cfg = BenchConfig(base_url=ns.base_url, model=ns.model, num_prompts=ns.num_prompts,
                      max_concurrency=ns.max_concurrency, request_rate=ns.request_rate, input_len=ns.input_len,
                      output_len=ns.output_len, dataset=ns.dataset, token_id_range=tuple(ns.token_id_range),
                      seed=ns.seed, api_key=ns.api_key or os.environ.get("OSTINATO_API_KEY"),
                      timeout_s=ns.timeout, num_warmups=ns.num_warmups)
    if not ns.disable_tqdm:
        print(f"bench serve: {cfg.num_warmups} warm-up request(s), then {cfg.num_prompts} to {cfg.base_url}",
              file=sys.stderr)
    summary = asyncio.run(run_benchmark(cfg, progress=not ns.disable_tqdm))
    print(format_table(summary))
    if ns.output_json:
        ns.output_json.write_text(json.dumps(summary, indent=2))
        print(f"wrote {ns.output_json}")
    return 0 if summary["failed"] == 0 else 1
