"""Runner: what the engine (and the tools driving an engine) may call on its runner.

Two classes satisfy it: ModelRunner (one rank, runner/runner.py) and TensorParallelRunner (rank 0 of several,
runner/tp_executor.py), so the callers need no probing for which one they hold. Typing only: no torch here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ostinato.config import CacheConfig
    from ostinato.contract import SchedulerOutput, StepResult
    from ostinato.runner.compile_watch import CompileWatch
    from ostinato.runner.graphs import GraphStats
    from ostinato.runner.pending import PendingStep
    from ostinato.runner.prefill_graphs import PrefillGraphStats
    from ostinato.runner.structured import GrammarMasks


@runtime_checkable
class Runner(Protocol):
    cache_config: CacheConfig  # the KV pool as sized at start-up; the scheduler hands out its blocks
    dtype: Any  # the torch dtype the model runs in
    block_size: int  # tokens a KV block holds
    compile_watch: CompileWatch

    def launch(self, out: SchedulerOutput, masks: GrammarMasks | None = None) -> PendingStep:
        """Run a step without waiting for its tokens (PendingStep.result() reads them). `masks` gives the
        constrained rows' grammar bitmasks (runner/structured.py); the engine passes it only when some running
        sequence is constrained."""

    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run a step and wait for its tokens."""

    def call_all(self, target: str, *args: Any) -> Any:
        """Run `target` ("module:function", taking a rank's ModelRunner first) on every rank; rank 0's result."""

    def rank_health(self) -> list[dict]:
        """Per rank of a tensor-parallel runner: {"rank", "alive", "error"}; empty for a single rank."""

    def shutdown(self) -> None:
        """Stop whatever the runner started (worker ranks); idempotent."""

    @property
    def kv_dtype(self) -> Any:
        """The KV pool's torch element type (--kv-cache-dtype; the model's dtype by default)."""

    def graph_stats(self) -> GraphStats: ...

    def prefill_graph_stats(self) -> PrefillGraphStats: ...

    @property
    def graph_status(self) -> str: ...

    @property
    def graphs_enabled(self) -> bool: ...

    @property
    def graph_disabled_cause(self) -> str | None: ...

    @property
    def captured_sizes(self) -> tuple[int, ...]: ...

    @property
    def graph_memory_bytes(self) -> int: ...

    @property
    def prefill_graph_memory_bytes(self) -> int: ...

    @property
    def graph_capture_seconds(self) -> float: ...
