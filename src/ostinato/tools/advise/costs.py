"""What `ostinato advise` measured on a GPU, and the pure arithmetic on it (no torch: tested on CPU).

`Measurements` is a plain record, saved and loaded as JSON (`--save-measurements`, `--measurements`), so a
recommendation can be redone for another workload without the GPU. `CostModel` answers the questions the
estimator asks, from those figures alone:

- decode step time at batch n and mean context c, eager or as the replay of a graph captured at size s.
  Measured on a grid (batch sizes x contexts) and interpolated linearly in batch, then in context; beyond
  the grid it extrapolates from the last two points (never below zero). Times are forward-only (input copies
  + replay, or the eager launches). Host work around the step is the same with and without graphs: it is
  not measured, and counts only when given (`--host-overhead-ms`); without it the gain is the forward's.
  A padded batch is charged the time of its graph's size at the real batch's context: padded rows carry
  context length 1, so they cost GEMM rows, not attention.
- prefill time of one prompt of L tokens (eager in both modes), interpolated over the measured lengths;
  a prefill step of several prompts is charged the sum (a slight overestimate: batching prompts saves
  launches).
- graph memory of a size set S: capture runs largest first into one shared pool, so the largest size pays
  the pool, the shared output and the capture stream's workspace (`first`, measured by capturing sizes
  alone), and every smaller size pays only what its capture added after the larger ones (`incremental`,
  from the full capture). memory(S) = first(max S) + sum of incremental(s) for the other s in S.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

from ostinato.errors import ConfigError

FORMAT_VERSION = 1


@dataclass(frozen=True)
class Measurements:
    """Decode, prefill and graph-memory figures of one model on one GPU. Times in milliseconds."""

    model: str
    device: str
    dtype: str
    torch_version: str
    batch_sizes: tuple[int, ...]  # ascending: where decode steps were timed (and graphs captured)
    contexts: tuple[int, ...]  # ascending: tokens per sequence in the cache when a decode step was timed
    eager_ms: tuple[tuple[float, ...], ...]  # [context][batch]
    graph_ms: tuple[tuple[float, ...], ...]  # [context][batch]
    prefill_lens: tuple[int, ...]  # ascending prompt lengths timed one at a time
    prefill_ms: tuple[float, ...]
    graph_first_bytes: Mapping[int, int]  # size -> bytes a capture of that size alone adds (pool included)
    graph_incremental_bytes: Mapping[int, int]  # size -> bytes it added captured after every larger size
    block_bytes: int  # one KV block, all layers, K and V
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_blocks_without_graphs: int  # usable KV blocks when no memory is set aside for graphs
    default_sizes: tuple[int, ...]  # the engine's default capture sizes for this max_num_seqs
    # The weights measured: their scheme (config.quantization_label) and device bytes. FP8 weights make every
    # step time above their own and leave more memory to the KV blocks; advice for one does not carry over.
    quantization: str = "none"
    weights_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("batch_sizes", "contexts", "prefill_lens"):
            values = getattr(self, name)
            if not values or list(values) != sorted(set(values)) or values[0] < 1:
                raise ConfigError(f"measurements: {name} must be ascending distinct positive integers, "
                                  f"got {list(values)}")
        for name in ("eager_ms", "graph_ms"):
            grid = getattr(self, name)
            if len(grid) != len(self.contexts) or any(len(row) != len(self.batch_sizes) for row in grid):
                raise ConfigError(f"measurements: {name} must have one row per context and one value per "
                                  "batch size")
        if len(self.prefill_ms) != len(self.prefill_lens):
            raise ConfigError("measurements: prefill_ms needs one value per prefill length")
        if not self.graph_incremental_bytes or not self.graph_first_bytes:
            raise ConfigError("measurements: graph memory figures are missing")

    # ---- JSON ------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        d = asdict(self)
        for key in ("graph_first_bytes", "graph_incremental_bytes"):
            d[key] = {str(k): v for k, v in sorted(d[key].items())}
        return {"format": "ostinato-advise-measurements", "version": FORMAT_VERSION, **d}

    @classmethod
    def from_json(cls, d: dict) -> "Measurements":
        if d.get("format") != "ostinato-advise-measurements":
            raise ConfigError("not an `ostinato advise` measurements file (write one with --save-measurements)")
        try:
            kw = {f.name: d[f.name] if f.default is MISSING else d.get(f.name, f.default) for f in fields(cls)}
            for key in ("graph_first_bytes", "graph_incremental_bytes"):
                kw[key] = {int(k): int(v) for k, v in kw[key].items()}
            for key in ("batch_sizes", "contexts", "prefill_lens", "default_sizes", "prefill_ms"):
                kw[key] = tuple(kw[key])
            for key in ("eager_ms", "graph_ms"):
                kw[key] = tuple(tuple(float(x) for x in row) for row in kw[key])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ConfigError(f"measurements file is incomplete or malformed ({type(e).__name__}: {e}); "
                              "measure again with --save-measurements") from None
        return cls(**kw)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Measurements":
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except OSError as e:
            raise ConfigError(f"cannot read measurements file {str(path)!r}: {e.strerror or e}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"measurements file {str(path)!r} is not JSON: {e}") from None


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear y(x) through the points; linear extrapolation from the two end points outside them,
    clamped at 0. One point: a constant."""
    if len(xs) == 1:
        return float(ys[0])
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


class CostModel:
    """Step times and graph memory from Measurements (see the module docstring for the assumptions)."""

    def __init__(self, m: Measurements, host_ms: float = 0.0, host_ms_per_seq: float = 0.0):
        """host_ms + host_ms_per_seq * batch: host work around each decode step (scheduling, input building,
        sampling, detokenizing), the same with and without graphs. Not measured here; 0 by default, so
        the gain is the forward's. `ostinato bench engine` minus the replay gives the figures to pass in."""
        self.m = m
        self.host_ms, self.host_ms_per_seq = host_ms, host_ms_per_seq
        # The largest captured size's increment is its first-capture cost (pool included), not what one
        # more graph adds: leave it out of the incremental curve unless it is the only point.
        sizes = sorted(m.graph_incremental_bytes)
        sizes = sizes[:-1] if len(sizes) > 1 else sizes
        self._inc = (sizes, [m.graph_incremental_bytes[s] for s in sizes])
        firsts = sorted(m.graph_first_bytes)
        self._first = (firsts, [m.graph_first_bytes[s] for s in firsts])

    def _grid(self, grid: tuple[tuple[float, ...], ...], batch: int, context: float) -> float:
        per_context = [interpolate(self.m.batch_sizes, row, batch) for row in grid]
        return interpolate(self.m.contexts, per_context, context)

    def eager_ms(self, batch: int, context: float) -> float:
        return self._grid(self.m.eager_ms, batch, context)

    def graph_ms(self, size: int, context: float) -> float:
        """One replay of the graph captured at `size` (a batch padded to it costs this)."""
        return self._grid(self.m.graph_ms, size, context)

    def prefill_ms(self, prompt_len: int) -> float:
        return interpolate(self.m.prefill_lens, self.m.prefill_ms, prompt_len)

    def incremental_bytes(self, size: int) -> int:
        return int(interpolate(*self._inc, size))

    def first_bytes(self, size: int) -> int:
        return int(interpolate(*self._first, size))

    def graph_bytes(self, sizes: Sequence[int]) -> int:
        """memory(S) = first(max S) + incremental(s) for every other s (0 for no graphs)."""
        if not sizes:
            return 0
        top = max(sizes)
        return self.first_bytes(top) + sum(self.incremental_bytes(s) for s in set(sizes) if s != top)

    def kv_blocks(self, sizes: Sequence[int]) -> int:
        """Usable KV blocks left when the graphs of `sizes` are captured."""
        return max(0, self.m.kv_blocks_without_graphs - math.ceil(self.graph_bytes(sizes) / self.m.block_bytes))

    def step_ms(self, sizes: Sequence[int], batch: int, context: float) -> float:
        """A decode step of `batch` sequences with these graphs: the replay of the smallest size >= batch,
        or eager above the largest size (and always eager with no sizes)."""
        i = bisect.bisect_left(sizes, batch)
        forward = self.graph_ms(sizes[i], context) if i < len(sizes) else self.eager_ms(batch, context)
        return forward + self.host_ms + self.host_ms_per_seq * batch
