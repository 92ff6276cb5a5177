"""The engine's CUDA-graph decode path on CPU: an LLMEngine whose runner captures through RecordingGraphBackend.

The one place tests reach into the runner's construction (which backend records the graphs, which sizes are
captured), so that a change there is adapted here only. Everything after construction is the engine's own code:
padding to the captured size, the static buffers, the scratch block, the counters.
"""

from __future__ import annotations

from contextlib import contextmanager
from unittest import mock

from ostinato.config import EngineArgs, GraphConfig
from ostinato.engine.engine import LLMEngine
from ostinato.runner import kv_setup
from ostinato.runner.graph_backends import RecordingGraphBackend


@contextmanager
def recorded_graphs(sizes: tuple[int, ...], prefill_sizes: tuple[int, ...] = (), prefill_max_seqs: int = 16,
                    backend=RecordingGraphBackend):
    """While active, a new engine captures decode `sizes` (and prefill graphs of `prefill_sizes` tokens, up to
    prefill_max_seqs sequences) with `backend()` (RecordingGraphBackend), whatever the device."""

    def graph_config(self, device_is_cuda: bool) -> GraphConfig:
        return GraphConfig(False, tuple(sorted(sizes)), self.cuda_graph_fallback, self.skip_graph_check,
                           tuple(sorted(prefill_sizes)), prefill_max_seqs, self.mixed_step)

    with mock.patch.object(EngineArgs, "graph_config", graph_config), \
            mock.patch.object(kv_setup, "CudaGraphBackend", lambda device, **kwargs: backend()):
        yield


def engine_with_recorded_graphs(args: EngineArgs, sizes: tuple[int, ...], **prefill) -> LLMEngine:
    with recorded_graphs(sizes, **prefill):
        return LLMEngine(args)


def kv_pool(engine: LLMEngine):
    """Every layer's (K, V) cache tensors, [num_blocks + 1, block_size, kv_heads, head_dim] each; the last
    block is the scratch block padded rows write to."""
    return engine.runner.kv_caches
