"""Choose CUDA-graph capture sizes for a workload: least expected decode time under a memory budget.

The problem: decode steps come at batch size n with weight w(n) (how many steps run at n). A set S of
captured sizes runs a batch of n as the replay of the smallest s in S with s >= n, costing g(s), and a batch
above max S eagerly, costing e(n). S costs memory(S) = first(max S) + sum of inc(s) over the rest (the largest
graph pays the shared pool; see advise_costs). Minimize sum_n w(n) * cost_S(n) subject to memory(S) <= budget.

With the sizes sorted, the cost splits into independent intervals (s_{j-1}, s_j], each paying g(s_j), plus the
eager tail above the largest; the memory splits the same way. So a dynamic program over sorted candidates and
used memory is exact: D[j][u] = least cost of covering every batch <= c_j with a set whose largest size is
c_j and whose incremental memory is u units. It runs in O(m^2 * U) for m candidates and U memory units
(numpy along u).

Candidates default to the batch sizes that occur (w(n) > 0). That loses nothing when g and memory do not
decrease with the size: a size that no batch equals can move down to the largest batch in its interval,
and neither cost nor memory grows. Memory is counted in units of ceil(budget / max_units) bytes, each item
rounded up, so a returned set always fits the budget; with budget <= max_units bytes the DP is exact.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SizeChoice:
    sizes: tuple[int, ...]  # ascending; () = no graphs
    expected_cost: float  # sum_n w(n) * cost(n)
    memory_bytes: int


def expected_cost(weights: Mapping[int, float], sizes: Sequence[int], graph_cost: Callable[[int], float],
                  eager_cost: Callable[[int], float]) -> float:
    """sum_n w(n) * (g(smallest size >= n) or e(n) above the largest). `sizes` ascending."""
    total = 0.0
    for n, w in weights.items():
        i = bisect.bisect_left(sizes, n)
        total += w * (graph_cost(sizes[i]) if i < len(sizes) else eager_cost(n))
    return total


def set_memory(sizes: Sequence[int], first_bytes: Callable[[int], int], inc_bytes: Callable[[int], int]) -> int:
    if not sizes:
        return 0
    top = max(sizes)
    return first_bytes(top) + sum(inc_bytes(s) for s in sizes if s != top)


def padded_rows(weights: Mapping[int, float], sizes: Sequence[int]) -> tuple[float, float, float]:
    """(padded rows, real rows in graph steps, eager steps), weighted by w: what a size set wastes."""
    pad = real = eager = 0.0
    for n, w in weights.items():
        i = bisect.bisect_left(sizes, n)
        if i < len(sizes):
            pad += w * (sizes[i] - n)
            real += w * n
        else:
            eager += w
    return pad, real, eager


def choose_sizes(
    weights: Mapping[int, float],
    graph_cost: Callable[[int], float],
    eager_cost: Callable[[int], float],
    first_bytes: Callable[[int], int],
    inc_bytes: Callable[[int], int],
    budget_bytes: int,
    candidates: Sequence[int] | None = None,
    max_units: int = 2000,
) -> SizeChoice:
    """The size set of least expected cost whose memory fits `budget_bytes` (ties: less memory).
    See the module docstring for the method and why candidates default to the observed batch sizes."""
    weights = {int(n): float(w) for n, w in weights.items() if w > 0}
    cands = sorted(set(candidates if candidates is not None else weights))
    unit = max(1, math.ceil(budget_bytes / max_units)) if budget_bytes > 0 else 1
    # Costs are rounded up to units and the budget down, so a set that fits exactly (the default sizes under
    # the default budget) could look over it by up to one unit per size: the DP gets that much slack, and
    # every set it proposes is checked against the budget in bytes below.
    budget_u = budget_bytes // unit + len(cands) + 1 if budget_bytes > 0 else -1
    best = SizeChoice((), expected_cost(weights, (), graph_cost, eager_cost), 0)
    if not cands or budget_u < 0:
        return best
    batches = sorted(weights)
    cum = np.cumsum([weights[n] for n in batches])

    def weight_upto(c: int) -> float:  # total weight of batches <= c
        i = bisect.bisect_right(batches, c)
        return float(cum[i - 1]) if i else 0.0

    # tail[j]: the eager cost of every batch above c_j
    tail = [sum(w * eager_cost(n) for n, w in weights.items() if n > c) for c in cands]
    w_up = [weight_upto(c) for c in cands]
    g = [graph_cost(c) for c in cands]
    inc_u = [math.ceil(max(0, inc_bytes(c)) / unit) for c in cands]
    first_u = [math.ceil(max(0, first_bytes(c)) / unit) for c in cands]
    width = budget_u + 1
    inf = np.inf
    D = np.full((len(cands), width), inf)
    parent = np.full((len(cands), width), -1, dtype=np.int64)
    for j, c in enumerate(cands):
        k = inc_u[j]
        if k > budget_u:
            continue
        D[j, k] = w_up[j] * g[j]  # c_j is the smallest chosen size
        for i in range(j):
            cand = D[i, : width - k] + (w_up[j] - w_up[i]) * g[j]
            better = cand < D[j, k:]
            if better.any():
                D[j, k:][better] = cand[better]
                parent[j, k:][better] = i
    for j, c in enumerate(cands):
        limit = budget_u - first_u[j] + inc_u[j]  # the largest pays first() instead of inc()
        if limit < 0:
            continue
        row = D[j, : min(width, limit + 1)]
        for u in np.argsort(row, kind="stable"):  # cheapest first; the first set that truly fits
            if not np.isfinite(row[u]):
                break
            sizes = _walk_back(parent, inc_u, j, int(u), cands)
            mem = set_memory(sizes, first_bytes, inc_bytes)
            if mem > budget_bytes:
                continue
            cost = float(row[u]) + tail[j]
            if cost < best.expected_cost - 1e-12 or (abs(cost - best.expected_cost) <= 1e-12
                                                     and mem < best.memory_bytes):
                best = SizeChoice(sizes, cost, mem)
            break
    return best


def _walk_back(parent: np.ndarray, inc_u: list[int], j: int, u: int, cands: list[int]) -> tuple[int, ...]:
    sizes = []
    while j >= 0:
        sizes.append(cands[j])
        prev = int(parent[j, u])
        u -= inc_u[j]
        j = prev
    return tuple(sorted(sizes))
