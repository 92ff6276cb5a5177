"""Workloads for `ostinato advise`, in three forms, and what they make the engine do. Pure Python.

- parameters: prompt and output lengths (a number, or "A:B" drawn uniformly), and arrivals: a request rate
  (Poisson), a concurrency (closed loop: a client sends its next request when one finishes), or neither
  (every request at once, as `LLM.generate` does);
- a JSONL trace, one request a line: {"prompt_len": 812, "output_len": 120, "arrival_s": 0.5} (also
  accepted: prompt_tokens/input_len, output_tokens/max_tokens, arrival/timestamp);
- a histogram of decode batch sizes, as a running server exports it (`ostinato:decode_batch_size` in
  /metrics): read from a URL or a saved /metrics text file.

`simulate` plays a request workload through a model of the engine's scheduler (engine/scheduler.py): each
step decodes every running sequence whose prompt is done, and prefills chunks with the rest of
max_num_batched_tokens (first the prompts already started, then waiting prompts admitted in order while
seats and KV blocks allow; the chunk that ends a prompt samples its first token). Its assumptions: a sequence reserves
the KV blocks of its final length when admitted, so there is no preemption (the engine reserves as it grows and preempts
instead: the model is a little pessimistic about concurrency when the cache is tight); no prefix is cached; every
request runs to its output length (ignore_eos); step times come from a CostModel (measured, forward-only): a step costs
its decode plus prefill_ms of each chunk.
"""

from __future__ import annotations

import heapq
import json
import math
import random
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ostinato.errors import ConfigError

METRIC = "ostinato:decode_batch_size"


@dataclass(frozen=True)
class Request:
    arrival_s: float
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class Workload:
    """Either requests to simulate, or a measured decode batch-size histogram (then no simulation)."""

    name: str
    requests: tuple[Request, ...] = ()
    concurrency: int | None = None  # closed loop; arrivals in `requests` are then ignored
    batch_histogram: Mapping[int, float] = field(default_factory=dict)  # decode steps by batch size
    mean_prompt_len: float | None = None
    mean_output_len: float | None = None
    num_requests: int = 0

    @property
    def from_histogram(self) -> bool:
        return bool(self.batch_histogram)


def parse_length(text: str, what: str) -> tuple[int, int]:
    """'300' -> (300, 300); '50:500' -> (50, 500)."""
    try:
        lo, _, hi = text.partition(":")
        bounds = (int(lo), int(hi or lo))
    except ValueError:
        raise ConfigError(f"{what} must be a number or a range like 50:500, got {text!r}") from None
    if bounds[0] < 1 or bounds[1] < bounds[0]:
        raise ConfigError(f"{what} must be >= 1 with low <= high, got {text!r}")
    return bounds


def workload_from_params(prompt_len: str, output_len: str, num_requests: int, request_rate: float | None,
                         concurrency: int | None, seed: int = 0, name: str = "parameters") -> Workload:
    if num_requests < 1:
        raise ConfigError(f"--num-requests must be >= 1, got {num_requests}")
    if request_rate is not None and concurrency is not None:
        raise ConfigError("give --request-rate or --concurrency, not both")
    if request_rate is not None and request_rate <= 0:
        raise ConfigError(f"--request-rate must be > 0 requests/s, got {request_rate}")
    if concurrency is not None and concurrency < 1:
        raise ConfigError(f"--concurrency must be >= 1, got {concurrency}")
    p_lo, p_hi = parse_length(prompt_len, "--prompt-len")
    o_lo, o_hi = parse_length(output_len, "--output-len")
    rng = random.Random(seed)
    t, reqs = 0.0, []
    for _ in range(num_requests):
        if request_rate is not None and not math.isinf(request_rate):
            t += rng.expovariate(request_rate)
        reqs.append(Request(t, rng.randint(p_lo, p_hi), rng.randint(o_lo, o_hi)))
    return _with_means(Workload(name, tuple(reqs), concurrency))


def _with_means(w: Workload) -> Workload:
    n = len(w.requests)
    return Workload(w.name, w.requests, w.concurrency, {}, sum(r.prompt_len for r in w.requests) / n,
                    sum(r.output_len for r in w.requests) / n, n)


def _field(row: dict, names: tuple[str, ...], line: int, required: bool = True) -> float | None:
    for name in names:
        if name in row:
            return row[name]
    if required:
        raise ConfigError(f"trace line {line} lacks {names[0]!r} (or {', '.join(names[1:])})")
    return None


def workload_from_trace(path: str | Path, concurrency: int | None = None) -> Workload:
    """One JSON object a line (blank lines skipped); arrivals made relative to the first."""
    reqs = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read trace {str(path)!r}: {e.strerror or e}") from None
    for i, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
            prompt = int(_field(row, ("prompt_len", "prompt_tokens", "input_len"), i))
            output = int(_field(row, ("output_len", "output_tokens", "max_tokens"), i))
            arrival = float(_field(row, ("arrival_s", "arrival", "timestamp"), i, required=False) or 0.0)
        except (json.JSONDecodeError, TypeError, ValueError, AttributeError) as e:
            raise ConfigError(f"trace {str(path)!r} line {i} is not a request object: {e}") from None
        if prompt < 1 or output < 1:
            raise ConfigError(f"trace line {i}: prompt and output lengths must be >= 1")
        reqs.append(Request(arrival, prompt, output))
    if not reqs:
        raise ConfigError(f"trace {str(path)!r} holds no requests")
    t0 = min(r.arrival_s for r in reqs)
    reqs = sorted((Request(r.arrival_s - t0, r.prompt_len, r.output_len) for r in reqs), key=lambda r: r.arrival_s)
    return _with_means(Workload(f"trace {Path(path).name}", tuple(reqs), concurrency))


def read_metrics_text(source: str, timeout_s: float = 10.0) -> str:
    """GET an http(s) URL (a server's /metrics), or read a saved /metrics text file."""
    if source.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(source, timeout=timeout_s) as resp:
                return resp.read().decode()
        except OSError as e:
            raise ConfigError(f"cannot read metrics from {source}: {e}; is the server running (ostinato "
                              "serve) and is this its /metrics URL?") from None
    try:
        return Path(source).read_text()
    except OSError as e:
        raise ConfigError(f"--from-metrics {source!r} is neither an http(s) URL nor a readable file: "
                          f"{e.strerror or e}") from None


def workload_from_metrics(text: str, name: str = "server metrics") -> Workload:
    """The decode batch-size histogram (per-size step counts from its cumulative buckets; a bucket wider
    than one size is charged at its upper bound), plus mean prompt and output lengths when the request
    and token counters are there."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: list[tuple[float, float]] = []
    # by sample name: text exposition names a counter's family with or without _total, depending on the writer
    totals = {"ostinato:prompt_tokens_total": 0.0, "ostinato:generation_tokens_total": 0.0,
              "ostinato:request_success_total": 0.0}
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if fam.name == METRIC and s.name == METRIC + "_bucket" and s.labels.get("le") != "+Inf":
                    buckets.append((float(s.labels["le"]), s.value))
                elif s.name in totals:
                    totals[s.name] += s.value
    except ValueError as e:
        raise ConfigError(f"the metrics text is not Prometheus exposition format: {e}") from None
    if not buckets:
        raise ConfigError(f"no {METRIC} histogram in the metrics: is this an ostinato server's /metrics, "
                          "and has it served any request?")
    hist: dict[int, float] = {}
    prev = 0.0
    for le, cum in sorted(buckets):
        if cum - prev > 0:
            size = max(1, math.floor(le))
            hist[size] = hist.get(size, 0.0) + cum - prev
        prev = cum
    if not hist:
        raise ConfigError(f"the {METRIC} histogram is empty: the server has run no decode step yet")
    n = totals["ostinato:request_success_total"]
    return Workload(name, batch_histogram=hist, num_requests=int(n),
                    mean_prompt_len=totals["ostinato:prompt_tokens_total"] / n if n else None,
                    mean_output_len=totals["ostinato:generation_tokens_total"] / n if n else None)


# ---------------------------------------------------------------------------------------------- simulate


@dataclass(frozen=True)
class EngineLimits:
    max_num_seqs: int
    kv_blocks: int
    block_size: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass(frozen=True)
class SimResult:
    total_s: float
    prefill_s: float
    decode_s: float
    output_tokens: int
    steps_by_batch: Mapping[int, int]  # decode steps by batch size
    mean_context: float  # step-weighted mean context of decode steps
    truncated: int  # requests whose prompt + output exceeded max_model_len (output cut)
    prefill_steps: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.total_s if self.total_s > 0 else 0.0


def _fit_requests(w: Workload, limits: EngineLimits) -> tuple[list[tuple[int, int, int]], int]:
    """Each request as (prompt, output, KV blocks) cut to max_model_len, and how many were cut."""
    bs, cap_len = limits.block_size, limits.max_model_len
    truncated = 0
    reqs = []
    for r in w.requests:
        prompt = min(r.prompt_len, cap_len - 1)
        out = max(1, min(r.output_len, cap_len - prompt))
        truncated += int(prompt + out < r.prompt_len + r.output_len)
        reqs.append((prompt, out, math.ceil((prompt + out) / bs)))
    if any(blocks > limits.kv_blocks for _, _, blocks in reqs):
        raise ConfigError(f"a request needs more KV blocks than the cache holds ({limits.kv_blocks})")
    return reqs, truncated


def _feed_prefills(prefilling: deque[list[int]], budget: int, chunks: list[int]) -> int:
    """The prompts already prefilling take their next chunks, oldest first, while the step's token budget
    lasts (appended to `chunks`); returns the budget left."""
    for entry in prefilling:
        if budget <= 0:
            break
        take = min(entry[1], budget)
        entry[1] -= take
        budget -= take
        chunks.append(take)
    return budget


def simulate(w: Workload, limits: EngineLimits, step_ms: Callable[[int, float], float],
             prefill_ms: Callable[[int], float]) -> SimResult:
    """Play the requests through the scheduler model (module docstring) and add up measured step times."""
    reqs, truncated = _fit_requests(w, limits)
    closed = w.concurrency is not None
    arrivals = [0.0] * min(len(reqs), w.concurrency) if closed else [r.arrival_s for r in w.requests]
    t = prefill_s = decode_s = 0.0
    nxt = 0  # next request not yet arrived
    waiting: deque[int] = deque()
    finish: list[tuple[int, int]] = []  # heap of (decode step it finishes at, request index)
    running = sum_ctx = step = tokens = done = prefill_steps = 0
    free = limits.kv_blocks
    steps: dict[int, int] = {}
    ctx_weighted = 0.0

    def finished(blocks: int) -> None:
        nonlocal free, done
        free += blocks
        done += 1
        if closed and len(arrivals) < len(reqs):  # that client sends its next request now
            arrivals.append(t)
    prefilling: deque[list[int]] = deque()  # [request index, prompt tokens not yet fed], oldest first
    while done < len(reqs):
        while nxt < len(arrivals) and arrivals[nxt] <= t:
            waiting.append(nxt)
            nxt += 1
        chunks: list[int] = []  # this step's chunk sizes
        completed: list[int] = []  # requests whose prompt ends in this step
        budget = _feed_prefills(prefilling, limits.max_num_batched_tokens - running, chunks)
        while waiting and running + len(prefilling) < limits.max_num_seqs and budget > 0:
            prompt, out, blocks = reqs[waiting[0]]
            if blocks > free:
                break
            free -= blocks
            take = min(prompt, budget)
            prefilling.append([waiting.popleft(), prompt - take])
            budget -= take
            chunks.append(take)
        while prefilling and prefilling[0][1] == 0:
            completed.append(prefilling.popleft()[0])
        if not chunks and not running:
            assert nxt < len(arrivals), "nothing running, waiting or due: the simulation would stall"
            t = max(t, arrivals[nxt])
            continue
        dt_decode = step_ms(running, sum_ctx / running) / 1e3 if running else 0.0
        dt_prefill = sum(prefill_ms(c) for c in chunks) / 1e3
        if running:
            steps[running] = steps.get(running, 0) + 1
            ctx_weighted += sum_ctx / running
            tokens += running
            sum_ctx += running
        prefill_steps += bool(chunks)
        t += dt_decode + dt_prefill
        decode_s += dt_decode
        prefill_s += dt_prefill
        step += 1
        while finish and finish[0][0] <= step:
            _, i = heapq.heappop(finish)
            prompt, out, blocks = reqs[i]
            running -= 1
            sum_ctx -= prompt + out
            finished(blocks)
        tokens += len(completed)
        for i in completed:  # sampled its first token; decodes from the next step on
            prompt, out, blocks = reqs[i]
            if out == 1:
                finished(blocks)
                continue
            running += 1
            sum_ctx += prompt + 1
            heapq.heappush(finish, (step + out - 1, i))
    n_steps = sum(steps.values())
    return SimResult(t, prefill_s, decode_s, tokens, steps, ctx_weighted / n_steps if n_steps else 0.0, truncated,
                     prefill_steps)
