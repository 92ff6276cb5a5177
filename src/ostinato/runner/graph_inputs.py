"""What a CUDA-graph runner (runner/graphs.py) is given and reports: its static inputs, the size a batch replays
at, the checks an input or a step's output must pass, and the capture report and step counters."""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ostinato.errors import ConfigError
from ostinato.runner.memory import MiB


class GraphInputError(ConfigError):
    """An input that does not fit the captured static buffers (too wide, wrong dtype or device, unknown
    name). Raised before any replay; nothing is copied or truncated."""


def pick_graph_size(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size >= n (the graph a batch of n is padded to), or None when n is above the
    largest size (that batch runs eager). `sizes` must be ascending."""
    if n < 1:
        raise ValueError(f"batch size must be >= 1, got {n}")
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True)
class StaticInput:
    """One persistent input buffer: allocated once at its largest shape, copied into before each replay.

    shape is the full shape, dim 0 the largest batch (>= the largest capture size); trailing dims are the
    largest the input may ever be (e.g. a block table's width = ceil(max_model_len / block_size)).
    pad_value fills padded rows and the unused right part of narrower inputs (for a block table: the
    scratch block; for a slot mapping: a scratch slot).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pad_value: int | float | bool = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if not self.name.isidentifier():
            raise ConfigError(f"static input name {self.name!r} must be a Python identifier (fn takes it as a keyword)")
        if not self.shape or any(d < 1 for d in self.shape):
            raise ConfigError(f"static input {self.name!r}: shape must be non-empty and positive, got "
                              f"{self.shape}")
        if not isinstance(self.dtype, torch.dtype):
            raise ConfigError(f"static input {self.name!r}: dtype must be a torch.dtype, got {self.dtype!r}")


@dataclass(frozen=True)
class CaptureReport:
    """What capture() did. Memory is device memory each capture added (torch.cuda.mem_get_info deltas:
    the graph pool plus the driver's graph objects), keyed by size in capture order (largest first)."""

    sizes: tuple[int, ...]  # captured, ascending; () when graphs are off
    bytes_by_size: Mapping[int, int]
    pool_bytes: int  # growth of the caching allocator's reservation (the shared graph pool)
    seconds: float  # the whole capture
    disabled_cause: str | None = None

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_size.values())

    def summary(self) -> str:
        if self.disabled_cause is not None:
            return f"CUDA graphs off: {self.disabled_cause}"
        return (f"captured {len(self.sizes)} CUDA graphs (sizes {self.sizes[0]}..{self.sizes[-1]}) in "
                f"{self.seconds:.2f} s using {self.total_bytes / MiB:.1f} MiB")


@dataclass(frozen=True)
class GraphStats:
    """Counters since construction. Every decode step is either a graph step or an eager step."""

    captured_sizes: tuple[int, ...]
    graph_steps: int
    eager_steps: int  # oversize steps plus every step while graphs are disabled
    oversize_steps: int  # eager because the batch was above the largest captured size
    real_rows: int  # rows of graph steps that carried a sequence
    padded_rows: int  # rows of graph steps computed only to fill the graph
    replays_by_size: Mapping[int, int]
    disabled_cause: str | None
    steps_by_batch: Mapping[int, int] = field(default_factory=dict)  # real batch size -> decode steps (graph or eager)

    @property
    def graphs_enabled(self) -> bool:
        return self.disabled_cause is None

    @property
    def padding_fraction(self) -> float:
        """Share of graph rows that were padding (wasted compute)."""
        rows = self.real_rows + self.padded_rows
        return self.padded_rows / rows if rows else 0.0

    def combined(self, other: "GraphStats") -> "GraphStats":
        """These counters plus another graph set's over the same steps (the decode graphs with the logits
        processors beside those without): one step is counted in one of them. The sizes stay these."""
        def merge(a: Mapping[int, int], b: Mapping[int, int]) -> dict[int, int]:
            return {k: a.get(k, 0) + b.get(k, 0) for k in sorted({*a, *b})}

        return GraphStats(self.captured_sizes, self.graph_steps + other.graph_steps,
                          self.eager_steps + other.eager_steps, self.oversize_steps + other.oversize_steps,
                          self.real_rows + other.real_rows, self.padded_rows + other.padded_rows,
                          merge(self.replays_by_size, other.replays_by_size),
                          self.disabled_cause or other.disabled_cause,
                          merge(self.steps_by_batch, other.steps_by_batch))


def same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def check_step_output(out: Any, size: int, trailing: tuple[int, ...] | None) -> None:
    """The step must return one tensor [size, *trailing] (trailing fixed by the largest size)."""
    if isinstance(out, torch.Tensor) and out.ndim > 0 and out.shape[0] == size \
            and (trailing is None or tuple(out.shape[1:]) == trailing):
        return
    got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
    raise GraphInputError(f"the step returned {got} for batch size {size}; it must return one tensor whose "
                          "dim 0 is the batch size and whose other dims do not depend on it")


def validate_inputs(inputs: Mapping[str, torch.Tensor], specs: Mapping[str, StaticInput], device: torch.device) -> int:
    """Check every input against its static buffer (`specs`, by name) before anything is copied; returns the
    batch size."""
    if inputs.keys() != specs.keys():
        missing, unknown = specs.keys() - inputs.keys(), inputs.keys() - specs.keys()
        raise GraphInputError(f"inputs must be exactly {sorted(specs)}; missing {sorted(missing)}, "
                              f"unknown {sorted(unknown)}")
    batch = {name: x.shape[0] if isinstance(x, torch.Tensor) and x.ndim else None
             for name, x in inputs.items()}
    for name, x in inputs.items():
        spec = specs[name]
        if not isinstance(x, torch.Tensor):
            raise GraphInputError(f"input {name!r} must be a tensor, got {type(x).__name__}")
        if x.ndim != len(spec.shape):
            raise GraphInputError(f"input {name!r} has {x.ndim} dims, its static buffer {len(spec.shape)} "
                                  f"(shape {spec.shape})")
        if x.dtype != spec.dtype:
            raise GraphInputError(f"input {name!r} is {x.dtype}, its static buffer {spec.dtype}; convert "
                                  "it before the step (no silent casts)")
        if not same_device(x.device, device):
            raise GraphInputError(f"input {name!r} is on {x.device}, the graphs on {device}; move it "
                                  "there before the step")
        for dim, (got, cap) in enumerate(zip(x.shape[1:], spec.shape[1:]), start=1):
            if got > cap:
                raise GraphInputError(
                    f"input {name!r} is {got} wide in dim {dim} but was captured {cap} wide (buffer shape "
                    f"{spec.shape}); it is never truncated: allocate the static input at the largest "
                    "width it can take (for a block table ceil(max_model_len / block_size))")
    sizes = set(batch.values())
    if len(sizes) != 1:
        raise GraphInputError(f"inputs disagree on the batch size (dim 0): {batch}")
    n = sizes.pop()
    if n < 1:
        raise GraphInputError("empty batch: a step needs at least one row")
    return n
