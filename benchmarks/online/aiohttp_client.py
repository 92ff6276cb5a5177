"""An independent streaming load generator for any OpenAI-compatible /v1/completions server, on aiohttp.

It shares no code with ostinato (`ostinato bench serve` is ostinato's own), so a figure both agree on is not an
artefact of one client. It sends `--num-prompts` streaming requests, at most `--max-concurrency` in flight, each
a prompt of `--input-len` random token ids and exactly `--output-len` greedy output tokens (`ignore_eos`, as vLLM
and ostinato accept), and reports:

- output tok/s: completion tokens (from each stream's usage chunk) / the run's wall time;
- TTFT: request sent -> first chunk with text; ITL: the gaps between a stream's chunks with text;
  TPOT: (last chunk - first chunk) / (tokens - 1), per request; median and p99 of each.

    python3 benchmarks/online/aiohttp_client.py --base-url http://127.0.0.1:8000 --max-concurrency 64

`--json` prints one JSON object instead of the table (benchmarks/online/serve_vs_offline.py reads it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"median": 0.0, "p99": 0.0}
    ordered = sorted(values)
    return {"median": statistics.median(ordered) * 1e3,
            "p99": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))] * 1e3}


async def _one(session, url: str, model: str, prompt: list[int], output_len: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    stamps, tokens = [], 0
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            return {"ok": False, "error": f"HTTP {resp.status}: {(await resp.text())[:200]}"}
        async for line in resp.content:  # one SSE line at a time
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("text") for c in chunk.get("choices") or ()):
                stamps.append(now)
    if not stamps:
        return {"ok": False, "error": "no text streamed"}
    return {"ok": True, "tokens": tokens, "ttft": stamps[0] - sent,
            "itl": [b - a for a, b in zip(stamps, stamps[1:])],
            "tpot": (stamps[-1] - stamps[0]) / (tokens - 1) if tokens > 1 else None}


async def run(ns) -> dict:
    import aiohttp

    rng = random.Random(ns.seed)
    prompts = [[rng.randrange(*ns.token_id_range) for _ in range(ns.input_len)] for _ in range(ns.num_prompts)]
    url = ns.base_url.rstrip("/") + "/v1/completions"
    connector = aiohttp.TCPConnector(limit=ns.max_concurrency)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=ns.read_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = ns.model
        if model is None:
            async with session.get(ns.base_url.rstrip("/") + "/v1/models") as resp:
                model = (await resp.json())["data"][0]["id"]
        await _one(session, url, model, prompts[0], 4)  # warm-up, not counted
        gate = asyncio.Semaphore(ns.max_concurrency)

        async def limited(prompt):
            async with gate:
                return await _one(session, url, model, prompt, ns.output_len)

        start, cpu_start = time.perf_counter(), time.process_time()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        duration, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    done = [r for r in results if r["ok"]]
    tokens = sum(r["tokens"] for r in done)
    return {"client": "aiohttp", "completed": len(done), "failed": len(results) - len(done),
            "errors": sorted({r["error"] for r in results if not r["ok"]})[:3],
            "duration_s": duration, "output_tokens": tokens, "output_throughput": tokens / duration,
            "chunks": sum(len(r["itl"]) + 1 for r in done), "cpu_s": cpu,
            "ttft_ms": _percentiles([r["ttft"] for r in done]),
            "tpot_ms": _percentiles([r["tpot"] for r in done if r["tpot"] is not None]),
            "itl_ms": _percentiles([g for r in done for g in r["itl"]])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first of the server's /v1/models")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--token-id-range", type=int, nargs=2, default=(100, 500),
                   help="prompt ids are drawn from [LOW, HIGH): inside every supported vocabulary")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--read-timeout", type=float, default=300.0, help="seconds without a byte before a stream fails")
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    summary = asyncio.run(run(ns))
    if ns.json:
        print(json.dumps(summary))
    else:
        print(f"{summary['completed']} requests ({summary['failed']} failed), {summary['output_tokens']} tokens in "
              f"{summary['chunks']} chunks, {summary['duration_s']:.2f} s: {summary['output_throughput']:.0f} "
              "output tok/s")
        for key in ("ttft_ms", "tpot_ms", "itl_ms"):
            print(f"{key[:-3].upper():>5}: median {summary[key]['median']:.2f} ms, p99 {summary[key]['p99']:.2f} ms")
        for error in summary["errors"]:
            print("error:", error, file=sys.stderr)
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
