"""Start-up: size the KV pool, allocate it, capture the decode graphs, and report what graphs cost.

On a GPU (DESIGN.md rule 7): profile a worst-case prefill for the activation peak, capture the largest decode
size once into a throwaway pool to estimate graph memory, give the KV pool what is left of the budget
(runner/memory.py), then capture every size for real and report measured graph memory in KV blocks.
On CPU, or with --num-kv-blocks, the pool size is given and no graphs are captured.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..config import CacheConfig
from ..errors import CudaGraphCaptureError
from .graphs import CaptureReport, CudaGraphBackend, CudaGraphRunner, StaticInput
from .inputs import build_prefill_inputs
from .memory import KVCachePlan, graph_memory_report, kv_block_bytes, plan_kv_cache

if TYPE_CHECKING:
    from .runner import ModelRunner

logger = logging.getLogger(__name__)

CPU_KV_BUDGET_BYTES = 1 << 30  # default KV pool on CPU when --num-kv-blocks is not given


@dataclass
class KVSetup:
    cache_config: CacheConfig
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    graph_runner: CudaGraphRunner
    capture: CaptureReport
    report: str  # the start-up memory report, already logged
    plan: KVCachePlan | None  # the GPU budget split; None when the pool size was given (CPU, --num-kv-blocks)


def allocate_kv_cache(runner: "ModelRunner", num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (k, v) pair per layer, each [num_blocks + 1, block_size, num_kv_heads, head_dim]; the extra block is
    the scratch block padded rows use. Zeroed so that reads of never-written slots stay finite."""
    mc = runner.model_config
    pool = torch.zeros(mc.num_layers, 2, num_blocks + 1, runner.block_size, mc.num_kv_heads, mc.head_dim,
                       dtype=runner.dtype, device=runner.device)
    caches = [(pool[i, 0], pool[i, 1]) for i in range(mc.num_layers)]
    runner.model.bind_kv_caches(caches)
    return caches


def max_blocks_per_seq(runner: "ModelRunner") -> int:
    return math.ceil(runner.scheduler_config.max_model_len / runner.block_size)


def make_graph_runner(runner: "ModelRunner", num_blocks: int, sizes: tuple[int, ...], enforce_eager: bool,
                      fallback: str, progress: bool, backend: CudaGraphBackend | None = None) -> CudaGraphRunner:
    """The decode step's static inputs; padded rows point at the scratch block (index num_blocks)."""
    rows = max(sizes) if sizes else runner.scheduler_config.max_num_seqs
    scratch = num_blocks
    inputs = [
        StaticInput("input_ids", (rows,), torch.int64, 0),
        StaticInput("positions", (rows,), torch.int64, 0),
        StaticInput("slot_mapping", (rows,), torch.int64, scratch * runner.block_size),
        StaticInput("block_tables", (rows, max_blocks_per_seq(runner)), torch.int32, scratch),
        StaticInput("context_lens", (rows,), torch.int32, 1),
    ]
    return CudaGraphRunner(runner.decode_logits, inputs, sizes, runner.device, fallback=fallback,
                           enforce_eager=enforce_eager, progress=progress, backend=backend)


def _random_decode_inputs(runner: "ModelRunner", num_blocks: int, size: int) -> dict[str, torch.Tensor]:
    """Self-check inputs: random tokens and context lengths over random real blocks; K/V writes go to the
    scratch slot only, so the check never changes a real sequence's cache."""
    width = max_blocks_per_seq(runner)
    dev = runner.device
    ctx = torch.randint(1, width * runner.block_size + 1, (size,), device=dev, dtype=torch.int32)
    # Random real blocks, drawn independently: O(size x width), never O(num_blocks) (a pool of tiny blocks can
    # hold tens of millions). A block repeated within a row reads the same K/V in replay and eager alike.
    tables = torch.randint(0, num_blocks, (size, width), device=dev, dtype=torch.int32)
    return {
        "input_ids": torch.randint(0, runner.model_config.vocab_size, (size,), device=dev),
        "positions": (ctx - 1).to(torch.int64),
        "slot_mapping": torch.full((size,), num_blocks * runner.block_size, dtype=torch.int64, device=dev),
        "block_tables": tables,
        "context_lens": ctx,
    }


def _profile_activation_peak(runner: "ModelRunner") -> int:
    """Peak bytes a worst-case prefill (max_num_batched_tokens tokens in max_model_len-long sequences) adds on
    top of the weights, excluding the temporary KV pool it writes into."""
    from ..engine.request import ScheduledSeq, SchedulerOutput
    from ..sampling_params import SamplingParams

    sc = runner.scheduler_config
    tokens = sc.max_num_batched_tokens
    seq_len = min(sc.max_model_len, tokens)
    num_seqs = max(1, min(sc.max_num_seqs, tokens // seq_len))
    per_seq = math.ceil(seq_len / runner.block_size)
    tmp_blocks = num_seqs * per_seq
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    caches = allocate_kv_cache(runner, tmp_blocks)
    cache_bytes = torch.cuda.memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    params = SamplingParams(temperature=0.0, max_tokens=1)
    seqs = tuple(ScheduledSeq(i, tuple([1] * seq_len), 0, tuple(range(i * per_seq, (i + 1) * per_seq)), params, 0)
                 for i in range(num_seqs))
    out = SchedulerOutput("prefill", seqs)
    with torch.inference_mode():
        inp = build_prefill_inputs(out, runner.block_size, tmp_blocks, runner.device)
        hidden = runner.model(inp.input_ids, inp.positions, inp.meta)
        runner.model.compute_logits(hidden[inp.last_token_indices])
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base - cache_bytes
    del caches, inp, hidden
    gc.collect()
    torch.cuda.empty_cache()
    return max(0, peak)


def _estimate_graph_bytes(runner: "ModelRunner", largest: int, backend: CudaGraphBackend) -> int:
    """Capture the largest decode size once into a throwaway pool over a small temporary KV pool.

    The probe shares the real runner's backend (its capture stream), so what a capture stream costs once
    (its cuBLAS workspace) is counted in the estimate and not allocated a second time later."""
    tmp_blocks = max_blocks_per_seq(runner)
    caches = allocate_kv_cache(runner, tmp_blocks)
    probe = make_graph_runner(runner, tmp_blocks, (largest,), False, "error", progress=False, backend=backend)
    try:
        report = probe.capture()
        return report.total_bytes
    finally:
        del probe, caches
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def allocate_kv_and_graphs(runner: "ModelRunner") -> KVSetup:
    args, gc_cfg, mc = runner.args, runner.graph_config, runner.model_config
    block_bytes = kv_block_bytes(mc.num_layers, mc.num_kv_heads, mc.head_dim, runner.block_size,
                                 runner.dtype.itemsize)
    lines = []
    plan = None
    sizes = gc_cfg.capture_sizes
    backend = CudaGraphBackend(runner.device) if sizes else None
    estimate = 0
    if args.num_kv_blocks is not None:
        num_blocks = args.num_kv_blocks
    elif runner.device.type != "cuda":
        want = runner.scheduler_config.max_num_seqs * max_blocks_per_seq(runner)
        num_blocks = max(max_blocks_per_seq(runner), min(want, CPU_KV_BUDGET_BYTES // block_bytes))
    else:
        t0 = time.perf_counter()
        activation = _profile_activation_peak(runner)
        free, total = torch.cuda.mem_get_info()
        # Everything in use now except the allocator's cached free memory: weights, CUDA context, other
        # processes. Charged as "weights" so the budget counts the whole device, as vLLM does. Read before
        # the graph probe: what the probe leaves behind (the capture stream's workspace) is in its estimate.
        in_use = total - free - (torch.cuda.memory_reserved() - torch.cuda.memory_allocated())
        if not gc_cfg.enforce_eager:
            try:
                estimate = _estimate_graph_bytes(runner, max(sizes), backend)
            except CudaGraphCaptureError:
                if gc_cfg.fallback == "error":
                    raise
                # Opted into eager fallback: the real capture below fails the same way, warns once and
                # turns graphs off, so no memory is set aside for them.
                estimate = 0
        plan = plan_kv_cache(total, args.gpu_memory_utilization, in_use, activation, estimate, block_bytes,
                             runner.block_size, runner.scheduler_config.max_model_len)
        num_blocks = plan.num_blocks
        lines.append(plan.summary())
        lines.append(f"memory profiling took {time.perf_counter() - t0:.1f} s (weights "
                     f"{runner.weights_bytes / 2**30:.2f} GiB, activation peak {activation / 2**30:.2f} GiB, "
                     f"graph estimate {estimate / 2**20:.0f} MiB)")
    caches = allocate_kv_cache(runner, num_blocks)
    graphs = make_graph_runner(runner, num_blocks, sizes, gc_cfg.enforce_eager, gc_cfg.fallback,
                               progress=runner.device.type == "cuda", backend=backend)
    capture = graphs.capture()
    if graphs.graphs_enabled and sizes and not gc_cfg.skip_graph_check:
        with torch.inference_mode():
            graphs.check(lambda n: _random_decode_inputs(runner, num_blocks, n))
    if sizes and graphs.graphs_enabled:
        lines.append(graph_memory_report(capture.bytes_by_size, estimate, block_bytes, runner.block_size,
                                         runner.scheduler_config.max_model_len))
        lines.append(f"captured {len(capture.sizes)} decode graphs in {capture.seconds:.2f} s")
    elif graphs.disabled_cause:
        lines.append(f"CUDA graphs disabled: {graphs.disabled_cause}")
    lines.append(f"KV cache: {num_blocks} blocks x {runner.block_size} tokens "
                 f"({num_blocks * block_bytes / 2**30:.3f} GiB)")
    report = "\n".join(lines)
    for line in report.splitlines():
        logger.info(line)
    return KVSetup(CacheConfig(runner.block_size, num_blocks), caches, graphs, capture, report, plan)
