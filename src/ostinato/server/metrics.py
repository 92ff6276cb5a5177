"""Prometheus metrics of one server, named like vLLM's (`vllm:` becomes `ostinato:`) so dashboards carry over.

Two kinds:
- Latency histograms (TTFT, inter-token, end-to-end) observed per step on the engine thread, through
  AsyncEngine's StepObserver hook (StepHistogram: one writer, no lock per observation).
- Engine counters and gauges (queue sizes, KV usage, token totals, graph vs eager decode steps, ...) read
  from `engine.stats()` at scrape time and exposed by a custom collector, so they are never stale and the
  engine keeps no second copy of its counters.

Each ServerMetrics owns its registry (never the process-global one), so several apps, as in tests, can live in
one process.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Iterator, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ostinato.engine.outputs import EngineStats, RequestOutput

PREFIX = "ostinato:"

# Buckets reach down to 1 ms: a decode step that is one graph replay can take a few milliseconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0)


class _EngineStatsCollector(Collector):
    """Turns the latest EngineStats into metric families when the registry is collected."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: EngineStats | None = None  # set by ServerMetrics.render just before collection

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        if s is None:  # the engine is still loading
            return
        name = self.model_name

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + metric, doc, labels=["model_name"])
            g.add_metric([name], value)
            return g

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + metric, doc, labels=["model_name"])
            c.add_metric([name], value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", s.kv_usage)
        yield gauge("kv_cache_total_blocks", "Usable KV-cache blocks.", s.kv_blocks_total)
        yield gauge("kv_cache_free_blocks", "Free KV-cache blocks.", s.kv_blocks_free)
        yield counter("prompt_tokens", "Prompt tokens of requests whose prefill ran, once per request as in vLLM "
                      "(a prefill recomputed after preemption does not count again: see num_preemptions).",
                      s.prompt_tokens_total)
        yield counter("generation_tokens", "Generated tokens.", s.generation_tokens_total)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache (every admission, a "
                      "recompute after preemption included).", s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache (their K/V not computed).",
                      s.prefix_cache_hits)
        yield counter("kernel_compiles_in_service", "Triton kernels compiled after start-up, inside a live step "
                      "(each a 0.1-1 s stall for every running request; start-up warm-up should leave this 0).",
                      s.kernel_compiles_in_service)
        yield counter("num_preemptions", "Sequences preempted (their KV freed, to be recomputed).", s.num_preemptions)

        def by_path(metric: str, doc: str, graph: int, eager: int) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + metric, doc, labels=["model_name", "path"])
            c.add_metric([name, "graph"], graph)
            c.add_metric([name, "eager"], eager)
            return c

        decode_steps = by_path("decode_steps", "Decode steps by how they ran: one CUDA-graph replay, eager (graphs "
                               "off, or a batch above the largest captured size), or mixed (inside a prefill-graph "
                               "replay with the step's prompt chunks).", s.decode_steps_graph, s.decode_steps_eager)
        decode_steps.add_metric([name, "mixed"], s.decode_steps_mixed)
        yield decode_steps
        yield by_path("prefill_steps", "Prefill steps (a mixed step's chunks included) by how they ran: one "
                      "CUDA-graph replay at a captured token count, or eager.", s.prefill_steps_graph,
                      s.prefill_steps_eager)
        yield counter("padded_rows", "Padding rows computed and dropped: a batch of n replays the graph of the "
                      "smallest captured size >= n.", s.padded_rows)
        replays = CounterMetricFamily(PREFIX + "cuda_graph_replays", "Graph replays by captured batch size.",
                                      labels=["model_name", "size"])
        for size, count in sorted(s.replays_by_size.items()):
            replays.add_metric([name, str(size)], count)
        yield replays
        yield gauge("cuda_graph_captured_sizes", "Number of captured decode batch sizes.", len(s.captured_sizes))
        yield gauge("cuda_graph_max_size", "Largest captured decode batch size (0 without graphs).",
                    max(s.captured_sizes, default=0))
        yield gauge("cuda_graph_memory_bytes", "Device memory held by the CUDA-graph pool.", s.graph_memory_bytes)
        yield gauge("cuda_graph_capture_seconds", "Time spent capturing graphs at start-up.", s.graph_capture_seconds)
        weights = GaugeMetricFamily(PREFIX + "model_weights_bytes", "Device bytes of the loaded weights (one rank's), "
                                    "labelled with their quantization scheme (none, fp8-...).",
                                    labels=["model_name", "quantization"])
        weights.add_metric([name, s.quantization], s.weights_bytes)
        yield weights
        cache = GaugeMetricFamily(PREFIX + "cache_config_info", "The KV cache's configuration in its labels (value "
                                  "1): element type (--kv-cache-dtype) and tokens a block.",
                                  labels=["model_name", "cache_dtype", "block_size"])
        cache.add_metric([name, s.kv_cache_dtype, str(s.kv_block_size)], 1)
        yield cache
        yield gauge("cuda_graphs_enabled", "1 when decode steps run as CUDA-graph replays.", int(s.graphs_enabled))
        yield gauge("batch_invariant", "1 when the engine runs batch invariant (--batch-invariant): a request's "
                    "tokens do not depend on its batch.", int(s.batch_invariant))
        yield counter("spec_decode_num_drafts", "Speculative decoding: verify rows that carried proposed tokens.",
                      s.spec_decode_drafts)
        yield counter("spec_decode_num_draft_tokens", "Speculative decoding: tokens proposed.",
                      s.spec_decode_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Speculative decoding: proposed tokens accepted.",
                      s.spec_decode_accepted_tokens)
        yield decode_batch_size_histogram(name, s.decode_batch_sizes, s.max_num_seqs)


def _cumulative_buckets(bounds: Sequence[float], counts: Sequence[int]) -> list[tuple[str, int]]:
    """Prometheus buckets (le, observations <= le) from per-bucket counts; counts has one more entry than
    bounds, the observations above every bound (+Inf)."""
    buckets, seen = [], 0
    for le, count in zip([*map(floatToGoString, bounds), "+Inf"], counts):  # le="8.0", as Histogram writes it
        seen += count
        buckets.append((le, seen))
    return buckets


class StepHistogram(Collector):
    """A latency histogram observed by one thread (the one that sees the engine's steps) and collected at scrape
    time, with no lock per observation.

    Why not prometheus_client's Histogram: it locks its sum and a bucket on every observation, and the
    inter-token histogram is observed for every stream every step. That made ServerMetrics.on_step the largest
    part of the front reader thread's work per stream per step (benchmarks/online/front_reader_cost.py), done
    holding the GIL that the front's event loop needs to write the same steps' chunks. A scrape reads
    the counts as they stand: an observation made meanwhile may be in the buckets and not yet in the sum. It
    writes _bucket, _count and _sum, and no _created sample (the time the histogram was made).
    """

    def __init__(self, name: str, doc: str, bounds: Sequence[float], model_name: str):
        self.name, self.doc, self.model_name = name, doc, model_name
        self._bounds = tuple(bounds)
        self._counts = [0] * (len(self._bounds) + 1)  # per bucket, not cumulative; the last is above every bound
        self._sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect_left(self._bounds, value)] += 1  # value == bound counts in that bound's bucket (le)
        self._sum += value

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        family.add_metric([self.model_name], _cumulative_buckets(self._bounds, list(self._counts)),
                          sum_value=self._sum)
        yield family


def decode_batch_size_histogram(model_name: str, steps_by_batch: dict[int, int], max_num_seqs: int) -> Metric:
    """`ostinato:decode_batch_size`: sequences per decode step, one observation per step (graph or eager).

    One bucket per possible batch size (le = 1, 2, ..., max_num_seqs): the exact distribution, which
    `ostinato advise --from-metrics` turns into CUDA-graph capture sizes for the server's next start."""
    hist = HistogramMetricFamily(PREFIX + "decode_batch_size", "Sequences in each decode step (one observation "
                                 "per step; a bucket per batch size).", labels=["model_name"])
    sizes = range(1, max([max_num_seqs, *steps_by_batch]) + 1)
    buckets = _cumulative_buckets(sizes, [*(steps_by_batch.get(size, 0) for size in sizes), 0])
    hist.add_metric([model_name], buckets, sum_value=sum(n * c for n, c in steps_by_batch.items()))
    return hist


class ServerMetrics:
    """The metrics of one server: a StepObserver for AsyncEngine, and `render()` for GET /metrics."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.ttft = StepHistogram(PREFIX + "time_to_first_token_seconds", "Time from arrival to the first token.",
                                  TTFT_BUCKETS, model_name)
        self.itl = StepHistogram(PREFIX + "inter_token_latency_seconds", "Time between steps that gave a request "
                                 "new tokens.", ITL_BUCKETS, model_name)
        self.e2e = StepHistogram(PREFIX + "e2e_request_latency_seconds", "Time from arrival to the last token.",
                                 E2E_BUCKETS, model_name)
        for histogram in (self.ttft, self.itl, self.e2e):
            self.registry.register(histogram)
        self._success = Counter(PREFIX + "request_success", "Requests that ended, by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self.model_name = model_name
        self._engine = _EngineStatsCollector(model_name)
        self.registry.register(self._engine)
        # request id -> time it last got tokens. Engine thread only.
        self._progress: dict[str, float] = {}

    # ---- StepObserver (engine thread) -------------------------------------------------------------
    def on_step(self, outputs: list[RequestOutput], now: float) -> None:
        # The engine outputs a request in a step only when the step sampled tokens for it (DELTA and
        # CUMULATIVE requests every such step, FINAL_ONLY ones at the end), so each output is progress.
        for out in outputs:
            last = self._progress.pop(out.request_id, None)
            if last is None:
                first = out.first_token_time if out.first_token_time is not None else now
                self.ttft.observe(max(0.0, first - out.arrival_time))
            else:
                self.itl.observe(now - last)
            if out.finished:
                end = out.finished_time if out.finished_time is not None else now
                self.e2e.observe(max(0.0, end - out.arrival_time))
                reason = out.outputs[0].finish_reason if out.outputs else None
                self._success.labels(self.model_name, reason or "unknown").inc()
            else:
                self._progress[out.request_id] = now

    def on_request_aborted(self, request_id: str) -> None:
        self._progress.pop(request_id, None)
        self._success.labels(self.model_name, "abort").inc()

    # ---- scrape -----------------------------------------------------------------------------------------
    def render(self, stats: EngineStats | None) -> tuple[bytes, str]:
        """The exposition text (and its content type) with engine figures taken from `stats`."""
        self._engine.stats = stats
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
