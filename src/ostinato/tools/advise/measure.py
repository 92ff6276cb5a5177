"""The GPU half of `ostinato advise`: time decode and prefill and read graph memory through the engine's own
runner, into a `Measurements` record (tools/advise/costs.py). Everything torch-specific of `advise` lives here.

- Decode: at each captured batch size and each context, B rows of the engine's persistent decode batch over
  random block tables of the real KV pool; eager = the decode step launched op by op, graph = the rows'
  copy + one replay (sampling inside), as `ostinato bench` times them (bench.replay_ms): CUDA events,
  median of --iters after --warmup.
- Prefill: one prompt of L tokens through the model up to its last token's logits, eager.
- Graph memory: per-size increments from the engine's own start-up capture (CaptureReport.bytes_by_size,
  largest first); what a set whose largest size is s pays first (pool, shared output, capture workspace)
  from probe captures of single sizes, offset so the probe of the largest size equals the real capture's.
"""

from __future__ import annotations

import logging
import math

import torch

from ostinato.config import default_capture_sizes, quantization_label
from ostinato.errors import ConfigError, CudaGraphCaptureError
from ostinato.runner.memory import kv_block_bytes
from ostinato.tools.advise.costs import Measurements
from ostinato.tools.bench.decode import time_cuda, replay_ms

logger = logging.getLogger(__name__)


def _prefill_ms(runner, length: int, iters: int, warmup: int) -> float:
    from ostinato.engine.request import ScheduledSeq, SchedulerOutput
    from ostinato.runner.inputs import build_prefill_inputs
    from ostinato.sampling_params import SamplingParams

    blocks = tuple(range(math.ceil(length / runner.block_size)))
    seq = ScheduledSeq(0, tuple([1] * length), 0, blocks, SamplingParams(temperature=0.0, max_tokens=1), 0)
    inp = build_prefill_inputs(SchedulerOutput("prefill", (seq,)), runner.block_size, runner.scratch_block,
                               runner.device)

    def step():
        hidden = runner.model(inp.input_ids, inp.positions, inp.meta)
        runner.model.compute_logits(hidden[inp.last_token_indices])

    return time_cuda(step, iters, warmup)


def _first_bytes(runner, sizes: list[int]) -> dict[int, int]:
    """Bytes a capture of each size alone adds (probes into throwaway pools, after every timing: a probe
    rebinds the model to a temporary KV pool, so the real one is bound back at the end)."""
    out = {}
    try:
        for size in sizes:
            try:
                out[size] = runner.probe_decode_graph_bytes(size)
            except (CudaGraphCaptureError, torch.cuda.OutOfMemoryError) as e:  # no room: fewer probe points
                logger.warning("graph memory probe of size %d failed (%s); interpolating without it", size, e)
    finally:
        runner.model.bind_kv_caches(runner.kv_caches)
    return out


def measure(engine, contexts: list[int], prefill_lens: list[int], iters: int, warmup: int) -> Measurements:
    """Time and weigh everything the estimator needs on `engine` (an LLMEngine built with graphs on)."""
    runner = engine.runner
    if not runner.graphs_enabled:
        raise ConfigError(f"advise measures CUDA-graph replay against eager; here graphs are {runner.graph_status}")
    sc = engine.scheduler_config
    sizes = list(runner.captured_sizes)
    contexts = sorted({c for c in contexts if 0 < c < sc.max_model_len})
    prefill_lens = sorted({p for p in prefill_lens if 0 < p < sc.max_model_len})
    if not contexts or not prefill_lens:
        raise ConfigError(f"--contexts and prompt lengths must be below --max-model-len {sc.max_model_len}")
    gen = torch.Generator().manual_seed(0)
    eager, graph = [], []
    with torch.inference_mode():
        for ctx in contexts:
            e_row, g_row = [], []
            for b in sizes:
                e_ms, g_ms = replay_ms(runner, b, ctx, gen, iters, warmup)
                e_row.append(e_ms)
                g_row.append(g_ms)
                logger.info("context %d batch %d: eager %.3f ms, graph %.3f ms", ctx, b, e_row[-1], g_row[-1])
            eager.append(tuple(e_row))
            graph.append(tuple(g_row))
        prefill = [_prefill_ms(runner, n, max(3, iters // 4), 2) for n in prefill_lens]
    incremental = dict(runner.capture_report.bytes_by_size)
    probe_sizes = sorted({s for s in sizes if s in (1, 8, 32, 128)} | {sizes[0], sizes[-1]})
    probes = _first_bytes(runner, probe_sizes)
    plan, mc = runner.kv_plan, runner.model_config
    # Calibrate the probes to what start-up charged the KV budget for the largest size (its estimate, which
    # includes the capture stream's one-time workspace), so graph memory and KV blocks add up.
    charged = plan.graph_estimate_bytes if plan is not None and plan.graph_estimate_bytes else \
        incremental[sizes[-1]]
    offset = charged - probes.get(sizes[-1], charged)
    first = {s: max(0, b + offset) for s, b in probes.items()} or {sizes[-1]: charged}
    block_bytes = kv_block_bytes(mc.num_layers, mc.num_kv_heads, mc.head_dim, runner.block_size,
                                 runner.kv_dtype.itemsize)
    without = (plan.num_blocks + plan.graph_blocks if plan is not None
               else runner.cache_config.num_blocks + math.ceil(runner.graph_memory_bytes / block_bytes))
    return Measurements(
        model=engine.config.model_source,
        device=torch.cuda.get_device_name(runner.device), dtype=str(runner.dtype).replace("torch.", ""),
        torch_version=torch.__version__, batch_sizes=tuple(sizes), contexts=tuple(contexts),
        eager_ms=tuple(eager), graph_ms=tuple(graph), prefill_lens=tuple(prefill_lens), prefill_ms=tuple(prefill),
        graph_first_bytes=first, graph_incremental_bytes=incremental, block_bytes=block_bytes,
        block_size=runner.block_size, max_model_len=sc.max_model_len, max_num_seqs=sc.max_num_seqs,
        max_num_batched_tokens=sc.max_num_batched_tokens, kv_blocks_without_graphs=without,
        default_sizes=default_capture_sizes(sc.max_num_seqs),
        quantization=quantization_label(mc.quantization), weights_bytes=runner.weights_bytes,
    )
