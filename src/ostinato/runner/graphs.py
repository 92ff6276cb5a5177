"""Run a decode step as one CUDA-graph replay: capture per batch size, pad, copy into static inputs, replay.

`CudaGraphRunner` wraps any callable whose inputs are batch-major tensors. It works on its own, outside
ostinato::

    def step(token_ids, positions):            # [n] int64 each -> [n, vocab] logits
        return model(token_ids, positions)

    runner = CudaGraphRunner(
        step,
        inputs=[StaticInput("token_ids", (64,), torch.int64, pad_value=0),
                StaticInput("positions", (64,), torch.int64, pad_value=0)],
        capture_sizes=plan_capture_sizes(max_num_seqs=64),
        device="cuda",
    )
    runner.capture()                                        # largest size first, one shared memory pool
    runner.check(lambda n: {"token_ids": torch.randint(0, vocab, (n,), device="cuda"),
                            "positions": torch.arange(n, device="cuda")})
    logits = runner.run(token_ids=ids, positions=pos)      # a view into the graph's static output

The rules it keeps: a batch of n replays the graph of the
smallest captured size >= n, with rows [n:size] of every input set to that input's pad value (for a paged
cache: the scratch block, so padded rows never touch a real sequence's KV); inputs are copied into
persistent buffers, never baked in; an input wider than its buffer is an error, never truncated; a
failed capture or self-check stops start-up with the size and the cause unless fallback="eager" was
chosen, and every eager step is counted either way.

What is captured must not synchronize with the host: no .item(), .cpu(), .tolist(), Python branches on
tensor values or data-dependent shapes inside `fn`.

Capture and replay go through a small backend (`CudaGraphBackend` by default). `RecordingGraphBackend`
stands in for it on any device, so padding, guards, counters and the fallback policy are tested on CPU
through the very code that runs on the GPU.
"""

from __future__ import annotations

import functools
import gc
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from ostinato.config import GraphConfig, plan_capture_sizes  # noqa: F401 (re-exported)
from ostinato.errors import ConfigError, CudaGraphCaptureError
from ostinato.runner.graph_backends import (  # noqa: F401 (re-exported: the runner's public API)
    CudaGraphBackend, GraphBackend, MemoryReading, RecordingGraphBackend)
from ostinato.runner.graph_checks import default_compare, describe_capture_failure
from ostinato.runner.graph_inputs import (  # noqa: F401 (re-exported: the runner's public API)
    CaptureReport, GraphInputError, GraphStats, StaticInput, check_step_output, pick_graph_size, validate_inputs)

__all__ = [
    "CaptureReport", "CudaGraphBackend", "CudaGraphRunner", "GraphBackend", "GraphInputError", "GraphStats",
    "MemoryReading", "RecordingGraphBackend", "StaticInput", "default_compare", "describe_capture_failure",
    "pick_graph_size", "plan_capture_sizes",
]

logger = logging.getLogger(__name__)

FALLBACK_POLICIES = ("error", "eager")
_FALLBACK_HINT = (" To serve without graphs instead, pass --cuda-graph-fallback eager (fallback='eager'), "
                  "or --enforce-eager to skip capture.")


class CudaGraphRunner:
    """Captures `fn` once per batch size and replays it on persistent (static) input buffers.

    fn(**views) is called with every buffer sliced to [:size]; the tensor it returns (dim 0 = size)
    becomes that graph's static output. `run(**inputs)` pads a batch of n to the smallest captured size,
    copies the inputs in, replays, and returns output[:n]: a view into the static output, overwritten by
    the next replay — clone it to keep it. Batches above the largest size, and every batch when graphs
    are disabled, call fn(**inputs) eagerly; `stats` counts both.

    fallback: "error" (a failed capture or self-check raises CudaGraphCaptureError) or "eager" (one
    WARNING, graphs dropped, every step eager). enforce_eager=True never captures.
    Not thread-safe: one runner serves one decode loop.
    """

    def __init__(
        self,
        fn: Callable[..., torch.Tensor],
        inputs: Sequence[StaticInput],
        capture_sizes: Sequence[int],
        device: torch.device | str,
        fallback: str = "error",
        pool: Any = None,
        warmup_iters: int = 2,
        progress: bool = False,
        enforce_eager: bool = False,
        backend: GraphBackend | None = None,
        buffers: Mapping[str, torch.Tensor] | None = None,
        step_name: str = "decode step",
    ):
        if fallback not in FALLBACK_POLICIES:
            raise ConfigError(f"fallback must be 'error' or 'eager', got {fallback!r}")
        if warmup_iters < 0:
            raise ConfigError(f"warmup_iters must be >= 0, got {warmup_iters}")
        self.fn = fn
        self.inputs = {spec.name: spec for spec in inputs}
        if len(self.inputs) != len(inputs) or not inputs:
            raise ConfigError(f"static inputs need distinct names, got {[s.name for s in inputs]}")
        self.device = torch.device(device)
        self.fallback = fallback
        self.warmup_iters = warmup_iters
        self.progress = progress
        self.step_name = step_name  # what the fallback warning says runs eager
        self._pool = pool
        self._sizes: tuple[int, ...] = tuple(sorted(set(capture_sizes)))
        self._disabled_cause: str | None = None
        if enforce_eager:
            self._sizes = ()
            self._disabled_cause = "enforce_eager: CUDA graphs turned off by configuration"
        else:
            self._validate_sizes()
        if backend is None and not enforce_eager:
            backend = CudaGraphBackend(self.device)  # raises ConfigError for a non-CUDA device
        self._backend: GraphBackend | None = backend
        # name -> full static buffer. Given (`buffers`): the caller owns them and may fill them itself and call
        # replay_filled(); otherwise capture() allocates them and run() copies into them.
        self._buffers: dict[str, torch.Tensor] = dict(buffers or {})
        if buffers is not None:
            for name, spec in self.inputs.items():
                buf = self._buffers.get(name)
                if buf is None or tuple(buf.shape) != spec.shape or buf.dtype != spec.dtype:
                    raise ConfigError(f"buffer {name!r} must be {spec.shape} {spec.dtype}")
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}  # size -> (replay, output)
        self._shared_out: torch.Tensor | None = None  # [largest size, ...]: every graph's output rows
        self._captured = False
        self._graph_steps = self._eager_steps = self._oversize_steps = 0
        self._real_rows = self._padded_rows = 0
        self._replays_by_size: dict[int, int] = {}
        self._steps_by_batch: dict[int, int] = {}  # the server's decode_batch_size histogram

    @classmethod
    def from_config(cls, fn: Callable[..., torch.Tensor], inputs: Sequence[StaticInput], config: GraphConfig,
                    device: torch.device | str, **kwargs: Any) -> "CudaGraphRunner":
        """Build from ostinato's GraphConfig (skip_graph_check is the caller's: it decides on check())."""
        return cls(fn, inputs, config.capture_sizes, device, fallback=config.fallback,
                   enforce_eager=config.enforce_eager, **kwargs)

    def _validate_sizes(self) -> None:
        if not self._sizes:
            raise ConfigError("no CUDA-graph capture sizes given; pass some or run with enforce_eager=True")
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in self._sizes):
            raise ConfigError(f"capture sizes must be positive integers, got {self._sizes}")
        largest = self._sizes[-1]
        for spec in self.inputs.values():
            if spec.shape[0] < largest:
                raise ConfigError(f"static input {spec.name!r} holds {spec.shape[0]} rows but the largest "
                                  f"capture size is {largest}; allocate it with dim 0 >= {largest}")

    # ------------------------------------------------------------------------------------ properties

    @property
    def captured_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    @property
    def graphs_enabled(self) -> bool:
        return self._disabled_cause is None

    @property
    def disabled_cause(self) -> str | None:
        return self._disabled_cause

    @property
    def stats(self) -> GraphStats:
        return GraphStats(
            captured_sizes=self.captured_sizes, graph_steps=self._graph_steps, eager_steps=self._eager_steps,
            oversize_steps=self._oversize_steps, real_rows=self._real_rows, padded_rows=self._padded_rows,
            replays_by_size=dict(self._replays_by_size), disabled_cause=self._disabled_cause,
            steps_by_batch=dict(self._steps_by_batch),
        )

    # --------------------------------------------------------------------------------------- capture

    def capture(self) -> CaptureReport:
        """Capture one graph per size, largest first (later, smaller graphs reuse the pool memory the
        larger ones freed), all in one memory pool, each after `warmup_iters` eager calls."""
        if self._captured:
            raise RuntimeError("capture() was already called on this runner")
        self._captured = True
        if self._disabled_cause is not None:
            return CaptureReport((), {}, 0, 0.0, self._disabled_cause)
        steps = self.step_calls()  # the buffers allocated before the first memory reading
        start = time.perf_counter()
        gc.collect()  # once, here: the backend keeps the collector off during each capture
        bytes_by_size: dict[int, int] = {}
        assert self._backend is not None
        pool = self._pool if self._pool is not None else self._backend.new_pool()
        # The first (largest) size is charged from here, before its warm-up: what a graph set costs beyond its
        # pool (e.g. the cuBLAS workspace of the capture stream) shows up once, not nowhere.
        first_reading = self._backend.memory_in_use()
        reserved_before = first_reading.reserved_bytes
        bar = tqdm(total=len(self._sizes), desc="Capturing CUDA graphs", unit="graph",
                   disable=not self.progress)
        try:
            for size, step in zip(reversed(self._sizes), steps):
                bar.set_postfix(size=size)
                try:
                    self._backend.warmup(step, self.warmup_iters)
                    if self._shared_out is None:  # largest size: learn the output's shape and dtype
                        proto = step()
                        check_step_output(proto, size, None)
                        self._shared_out = torch.empty((size, *proto.shape[1:]), dtype=proto.dtype,
                                                       device=proto.device)
                        del proto
                    before = first_reading if not self._graphs else self._backend.memory_in_use()
                    replay, out = self._backend.capture(functools.partial(self._step_into_shared, step, size),
                                                        pool)
                    after = self._backend.memory_in_use()
                except Exception as e:
                    self._fail(size, describe_capture_failure(size, e), e)
                    break
                if not isinstance(out, torch.Tensor) or out.ndim == 0 or out.shape[0] != size:
                    got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                    self._fail(size, f"the step returned {got} for batch size {size}; it must return one "
                                     "tensor whose dim 0 is the batch size", None)
                    break
                self._graphs[size] = (replay, out)
                bytes_by_size[size] = max(0, after.device_bytes - before.device_bytes)
                bar.update(1)
        finally:
            bar.close()
        seconds = time.perf_counter() - start
        pool_bytes = 0
        if self._disabled_cause is None:
            pool_bytes = max(0, self._backend.memory_in_use().reserved_bytes - reserved_before)
        report = CaptureReport(self.captured_sizes, bytes_by_size if self._graphs else {}, pool_bytes, seconds,
                               self._disabled_cause)
        logger.info(report.summary())
        return report

    def step_calls(self) -> list[Callable[[], torch.Tensor]]:
        """One call of the step per capture size, largest first, over views of the static buffers (allocated here
        where the caller gave none): what capture() records, and what runner/compile_ahead.py runs before it."""
        if not self._buffers:
            self._buffers = {
                spec.name: torch.full(spec.shape, spec.pad_value, dtype=spec.dtype, device=self.device)
                for spec in self.inputs.values()
            }
        return [functools.partial(self.fn, **{name: buf[:size] for name, buf in self._buffers.items()})
                for size in reversed(self._sizes)]

    def _step_into_shared(self, step: Callable[[], torch.Tensor], size: int) -> torch.Tensor:
        """Run the step and copy its output into the one output buffer all sizes share.

        Without this every graph keeps its own output alive: for logits of a 150k vocabulary that is
        size x 600 KB per graph, 2.5 GB over the default 35 sizes. The step's own output is freed at the
        end of the capture, so the next (smaller) graph reuses that pool memory.
        """
        out = step()
        check_step_output(out, size, tuple(self._shared_out.shape[1:]))
        shared = self._shared_out[:size]
        shared.copy_(out)
        return shared

    def _fail(self, size: int, message: str, error: BaseException | None) -> None:
        """A capture or self-check failed: drop every graph, then raise or (fallback="eager") warn once."""
        self._graphs.clear()
        self._shared_out = None
        assert self._backend is not None
        unusable = self._backend.recover()
        self._backend.release()
        # Set before raising too, so a caller that catches the error sees (and counts) eager steps.
        self._disabled_cause = f"batch size {size}: {message}"
        if unusable is not None:  # eager would fail too: never pretend to fall back
            raise CudaGraphCaptureError(f"{message} {unusable}.") from error
        if self.fallback == "error":
            raise CudaGraphCaptureError(message + _FALLBACK_HINT) from error
        logger.warning("CUDA graphs disabled, every %s runs eager (fallback='eager'): %s", self.step_name, message)

    def share_output_of(self, other: "CudaGraphRunner") -> None:
        """Capture into `other`'s static output (already captured, at least as many rows) instead of one of
        its own: of two graph sets over one step, one replays per step, so one output buffer serves both."""
        self._shared_out = other._shared_out

    def disable(self, size: int, message: str) -> None:
        """A check made outside check() failed at `size`: drop the graphs, then raise or warn per fallback."""
        self._fail(size, message, None)

    # ------------------------------------------------------------------------------------------ check

    def check(
        self,
        make_inputs: Callable[[int], Mapping[str, torch.Tensor]],
        compare: Callable[[Any, Any], str | None] = default_compare,
        side_output: Callable[[int], torch.Tensor] | None = None,
    ) -> float:
        """Replay every captured size on make_inputs(size) and compare with fn run eagerly on the same
        inputs; a mismatch is handled like a capture failure. Returns the seconds it took.

        fn runs twice per size (its side effects too, e.g. KV writes): run the check before serving, with
        inputs that write only to scratch slots. Counters are not touched.
        compare(graph_out, eager_out) returns None when they agree, else a description. With side_output
        (size -> a tensor the step writes besides its output, e.g. sampled tokens), compare gets
        (output, side output) pairs, the side output cloned right after each run.
        """
        if not self._captured:
            raise RuntimeError("call capture() before check()")
        if not self._graphs:
            return 0.0
        assert self._backend is not None
        start = time.perf_counter()
        for size in self.captured_sizes:
            inputs = dict(make_inputs(size))
            if self._validate(inputs) != size:
                raise GraphInputError(f"make_inputs({size}) must return inputs with {size} rows")
            eager_out = self.fn(**inputs)
            if side_output is not None:
                eager_out = (eager_out.clone(), side_output(size).clone())
            graph_out = self._replay(size, size, inputs)
            if side_output is not None:
                graph_out = (graph_out, side_output(size).clone())
            mismatch = compare(graph_out, eager_out)
            if mismatch is not None:
                self._fail(size, f"CUDA graph self-check failed for batch size {size}: {mismatch}. The replay "
                                 "computes something else than the eager step: usually a value fixed at "
                                 "capture (a Python branch on a tensor, a tensor replaced instead of copied "
                                 "into, a shape read from data). --skip-graph-check skips this check.", None)
                break
        self._backend.synchronize()
        seconds = time.perf_counter() - start
        if self.graphs_enabled:
            logger.info("CUDA graph self-check passed for %d sizes in %.2f s", len(self._graphs), seconds)
        return seconds

    # -------------------------------------------------------------------------------------------- run

    def run(self, **inputs: torch.Tensor) -> torch.Tensor:
        """One step on a batch of n (the inputs' dim 0). Graph replay when a captured size >= n exists
        (the result is a view into the static output, valid until the next replay), else fn(**inputs)."""
        n = self._validate(inputs)
        if self.graphs_enabled and not self._captured:
            raise RuntimeError("call capture() before run()")
        size = pick_graph_size(n, self._sizes) if self._graphs else None
        self._steps_by_batch[n] = self._steps_by_batch.get(n, 0) + 1
        if size is None:
            self._eager_steps += 1
            self._oversize_steps += int(self.graphs_enabled)
            return self.fn(**inputs)
        out = self._replay(size, n, inputs)
        self._count_replay(size, n)
        return out

    def graph_size(self, n: int) -> int | None:
        """The captured size a batch of n replays at, or None when it runs eager."""
        return pick_graph_size(n, self._sizes) if self._graphs else None

    def replay_filled(self, n: int, size: int | None = None) -> torch.Tensor:
        """One step on rows [0, n) of the caller's buffers, already filled, rows [n, graph_size(n)) with
        harmless padding. No validation and no copy: the caller owns the buffers (`buffers=`). Returns
        output[:n] (a view into the static output for a replay). `size`: replay that captured size (>= n)
        instead of the smallest, its rows [n, size) padded by the caller (a self-check of a large size)."""
        if size is not None and (size not in self._graphs or size < n):
            raise ValueError(f"replay_filled: size {size} is not a captured size >= {n}")
        size = size if size is not None else self.graph_size(n)
        self._steps_by_batch[n] = self._steps_by_batch.get(n, 0) + 1
        if size is None:
            self._eager_steps += 1
            self._oversize_steps += int(self.graphs_enabled)
            return self.fn(**{name: buf[:n] for name, buf in self._buffers.items()})
        replay, out = self._graphs[size]
        replay()
        self._count_replay(size, n)
        return out[:n]

    def _count_replay(self, size: int, n: int) -> None:
        self._graph_steps += 1
        self._real_rows += n
        self._padded_rows += size - n
        self._replays_by_size[size] = self._replays_by_size.get(size, 0) + 1

    def _validate(self, inputs: Mapping[str, torch.Tensor]) -> int:
        """Check every input against its static buffer before anything is copied; returns the batch size."""
        return validate_inputs(inputs, self.inputs, self.device)

    def _replay(self, size: int, n: int, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Copy validated inputs into the buffers, pad rows [n:size], replay, return output[:n]."""
        for name, x in inputs.items():
            buf, pad = self._buffers[name], self.inputs[name].pad_value
            if x.shape[1:] == buf.shape[1:]:
                buf[:n].copy_(x)
            else:  # narrower: left part from x, the rest padding (stale entries must not survive)
                buf[:n].fill_(pad)
                buf[(slice(0, n), *(slice(0, d) for d in x.shape[1:]))].copy_(x)
            if size > n:
                buf[n:size].fill_(pad)
        replay, out = self._graphs[size]
        replay()
        return out[:n]
