"""From measured costs and a workload to a verdict: are CUDA graphs worth it, and which sizes. Pure Python.

Three configurations are estimated end to end: eager (every KV block to the cache), the default capture
sizes, and the recommended ones. Graph memory comes out of the KV cache (CostModel.kv_blocks), so a size set
that takes more memory admits fewer sequences when the cache is the limit.

- A request workload is simulated per configuration (advise_workload.simulate): the decode batch sizes it
  runs, and so the steps it takes, follow from that configuration's step times and KV blocks.
- A histogram workload keeps the measured batch distribution as it is, except that batches larger than a
  configuration's KV capacity (sequences of mean prompt + output length that fit, when the metrics give
  those means) run as n / capacity steps at that capacity: the same tokens, more steps. Its prefill is
  num_requests prompts of the mean length; without those counters prefill is left out.

The recommended sizes come from choose_sizes (advise_sizes) on the decode batch distribution of the
default-size configuration, costed at its step-weighted mean context, under the memory budget (default:
what the default sizes take); the choice is then re-made once on its own distribution, keeping the better.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ostinato.tools.advise.costs import CostModel
from ostinato.tools.advise.sizes import choose_sizes, padded_rows
from ostinato.tools.advise.workload import EngineLimits, Workload, simulate

ASSUMPTIONS = (
    "decode step times are the measured forward (input copies + replay, or eager launches) plus the host "
    "work given with --host-overhead-ms (default none): with none, the gain is the forward's gain",
    "decode times are measured on a grid of batch sizes and contexts and interpolated linearly between",
    "a padded batch costs the replay of its graph's size; a batch above the largest size runs eager",
    "graph memory = the largest size's capture alone + what each smaller size adds to the shared pool; it "
    "comes out of the KV cache",
    "a prefill step costs the sum of its prompts' measured prefill times (eager either way)",
    "simulated requests reserve their final KV length on admission (no preemption) and run to their output "
    "length",
)


@dataclass(frozen=True)
class Estimate:
    """One configuration's end-to-end estimate."""

    name: str
    sizes: tuple[int, ...]
    graph_bytes: int
    kv_blocks: int
    max_len_seqs: int  # sequences at max_model_len the KV cache holds
    total_s: float
    prefill_s: float
    decode_s: float
    output_tokens: float
    steps_by_batch: Mapping[int, float]
    mean_context: float
    padded_rows: float
    real_rows: float
    eager_steps: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def decode_steps(self) -> float:
        return sum(self.steps_by_batch.values())

    @property
    def mean_batch(self) -> float:
        steps = self.decode_steps
        return sum(n * w for n, w in self.steps_by_batch.items()) / steps if steps else 0.0

    @property
    def padding_fraction(self) -> float:
        rows = self.padded_rows + self.real_rows
        return self.padded_rows / rows if rows else 0.0


@dataclass(frozen=True)
class Advice:
    workload: str
    eager: Estimate
    default: Estimate
    recommended: Estimate
    budget_bytes: int
    enable: bool
    gain: float  # recommended vs eager, end-to-end throughput ratio - 1
    verdict: str
    notes: tuple[str, ...] = ()  # what this workload's estimate rests on beyond ASSUMPTIONS
    assumptions: tuple[str, ...] = field(default=ASSUMPTIONS)


def estimate(cost: CostModel, w: Workload, name: str, sizes: Sequence[int]) -> Estimate:
    m = cost.m
    sizes = tuple(sorted(sizes))
    kv = cost.kv_blocks(sizes)
    if w.from_histogram:
        steps, prefill_s, out_tokens, ctx = _histogram_steps(cost, w, kv)
        decode_s = sum(c * cost.step_ms(sizes, n, ctx) for n, c in steps.items()) / 1e3
        total = prefill_s + decode_s
    else:
        limits = EngineLimits(m.max_num_seqs, kv, m.block_size, m.max_num_batched_tokens, m.max_model_len)
        sim = simulate(w, limits, lambda n, c: cost.step_ms(sizes, n, c), cost.prefill_ms)
        steps, prefill_s, decode_s, total = dict(sim.steps_by_batch), sim.prefill_s, sim.decode_s, sim.total_s
        out_tokens, ctx = sim.output_tokens, sim.mean_context
    pad, real, eager = padded_rows(steps, sizes)
    return Estimate(name, sizes, cost.graph_bytes(sizes), kv, kv // math.ceil(m.max_model_len / m.block_size),
                    total, prefill_s, decode_s, out_tokens, steps, ctx, pad, real, eager)


def _histogram_steps(cost: CostModel, w: Workload, kv_blocks: int):
    """(decode steps by batch, prefill seconds, output tokens, context) of a measured histogram."""
    m = cost.m
    p, o = w.mean_prompt_len, w.mean_output_len
    cap, ctx = m.max_num_seqs, m.contexts[len(m.contexts) // 2]
    prefill_s = 0.0
    if p is not None and o is not None:
        ctx = p + o / 2
        cap = max(1, min(cap, kv_blocks // max(1, math.ceil((p + o) / m.block_size))))
        prefill_s = w.num_requests * cost.prefill_ms(round(p)) / 1e3
    steps: dict[int, float] = {}
    for n, c in w.batch_histogram.items():
        k = min(n, cap)
        steps[k] = steps.get(k, 0.0) + c * n / k
    tokens = sum(n * c for n, c in w.batch_histogram.items()) + w.num_requests
    return steps, prefill_s, tokens, ctx


def _choose(cost: CostModel, base: Estimate, budget_bytes: int) -> tuple[int, ...]:
    ctx, limit = base.mean_context, cost.m.max_num_seqs
    weights = {n: c for n, c in base.steps_by_batch.items() if n <= limit}
    choice = choose_sizes(weights, lambda s: cost.graph_ms(s, ctx), lambda n: cost.eager_ms(n, ctx),
                          cost.first_bytes, cost.incremental_bytes, budget_bytes)
    return choice.sizes


def advise(cost: CostModel, w: Workload, budget_bytes: int | None = None, min_gain: float = 0.02) -> Advice:
    m = cost.m
    eager = estimate(cost, w, "eager", ())
    default = estimate(cost, w, "default sizes", m.default_sizes)
    budget = cost.graph_bytes(m.default_sizes) if budget_bytes is None else budget_bytes
    rec = estimate(cost, w, "recommended", _choose(cost, default, budget))
    again = _choose(cost, rec, budget)
    if again != rec.sizes:
        second = estimate(cost, w, "recommended", again)
        rec = second if second.total_s < rec.total_s else rec
    gain = eager.total_s / rec.total_s - 1 if rec.total_s > 0 else 0.0
    enable = bool(rec.sizes) and gain >= min_gain
    return Advice(w.name, eager, default, rec, budget, enable, gain,
                  _verdict(cost, eager, default, rec, gain, enable, min_gain, budget), _notes(cost, w))


def _notes(cost: CostModel, w: Workload) -> tuple[str, ...]:
    m = cost.m
    if not w.from_histogram:
        return (f"{len(w.requests)} requests simulated with max_num_seqs {m.max_num_seqs}, max_model_len "
                f"{m.max_model_len}, max_num_batched_tokens {m.max_num_batched_tokens} (as measured); "
                "requests longer than max_model_len are cut",)
    notes = [f"decode batch sizes as the server ran them ({sum(w.batch_histogram.values()):.0f} steps); only "
             "batches above a configuration's KV capacity are re-split"]
    if w.mean_prompt_len is None or w.mean_output_len is None:
        notes.append("the metrics carry no request counts: prefill is left out and steps are costed at context "
                     f"{m.contexts[len(m.contexts) // 2]}")
    else:
        notes.append(f"prefill: {w.num_requests} requests of {w.mean_prompt_len:.0f} prompt tokens (the mean); "
                     f"decode context {w.mean_prompt_len + w.mean_output_len / 2:.0f}")
    return tuple(notes)


def _verdict(cost: CostModel, eager: Estimate, default: Estimate, rec: Estimate, gain: float, enable: bool,
             min_gain: float, budget_bytes: int) -> str:
    m = cost.m
    blocks = eager.kv_blocks - rec.kv_blocks
    mem = (f"{rec.graph_bytes / 2**20:.0f} MiB = {blocks} KV blocks = {blocks * m.block_size} tokens "
           f"({blocks * m.block_size / m.max_model_len:.2f} sequences at max_model_len {m.max_model_len})")
    prefill_share = eager.prefill_s / eager.total_s if eager.total_s else 0.0
    default_gain = eager.total_s / default.total_s - 1 if default.total_s else 0.0
    if enable:
        count = f"{len(rec.sizes)} size{'s' if len(rec.sizes) > 1 else ''}"
        return (f"ENABLE CUDA graphs with {count} {_span(rec.sizes)}: estimated {gain:+.1%} "
                f"output throughput vs eager ({rec.tokens_per_s:.0f} vs {eager.tokens_per_s:.0f} tok/s; the "
                f"default {len(default.sizes)} sizes: {default_gain:+.1%}). Cost: {mem}. Prefill is "
                f"{prefill_share:.0%} of eager time.")
    if not rec.sizes:
        why = f"no size set within the memory budget ({budget_bytes / 2**20:.0f} MiB) beats eager"
    else:
        why = f"the best size set gains only {gain:+.1%} (< {min_gain:.0%})"
    return (f"LEAVE CUDA graphs OFF (--enforce-eager): {why}; prefill is {prefill_share:.0%} of eager time. "
            f"Eager keeps every KV block ({eager.kv_blocks}); the default sizes would give {default_gain:+.1%} "
            f"for {default.graph_bytes / 2**20:.0f} MiB.")


def _span(sizes: Sequence[int]) -> str:
    return "[" + " ".join(str(s) for s in sizes) + "]" if len(sizes) <= 12 else \
        f"[{' '.join(map(str, sizes[:6]))} ... {' '.join(map(str, sizes[-3:]))}]"
