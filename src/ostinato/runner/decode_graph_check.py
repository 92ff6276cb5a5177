"""Start-up self-check of the decode graphs (runner/graphs.py): each captured size replayed against the same step
run eagerly, on random greedy rows (kv_setup.allocate_kv_and_graphs runs it after the capture)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ostinato.runner.decode_batch import DecodeLayout
from ostinato.runner.decode_step import DecodeStep, compare_step
from ostinato.runner.graphs import CudaGraphRunner

if TYPE_CHECKING:
    from ostinato.runner.kv_setup import KVSpec


def check_decode_graphs(spec: KVSpec, step: DecodeStep, runners: tuple[CudaGraphRunner, ...]) -> None:
    """The start-up self-check of each decode graph set (unless --skip-graph-check), on random greedy rows."""
    if not spec.graph_config.capture_sizes or spec.graph_config.skip_graph_check:
        return
    for runner in runners:
        if runner.graphs_enabled:
            with torch.inference_mode():
                runner.check(lambda n: random_decode_rows(spec, step.layout, n), compare_step, step.sampled_rows)
            step.batch.reset()  # the check wrote its rows into the static buffer: padding again before serving


def random_decode_rows(spec: KVSpec, layout: DecodeLayout, size: int) -> dict[str, torch.Tensor]:
    """Self-check rows: random greedy tokens and context lengths over random real blocks.

    Rows run concurrently on the GPU, so no row may read a slot another row writes in the same step (the
    order of those writes and reads differs between runs, and eager and replay would disagree for no fault
    of the graph). Each row therefore writes its token's K/V into a block of its own, and reads its earlier
    positions from blocks no row writes. Those are real blocks: the check runs at start-up, before any
    sequence holds KV. With fewer blocks than rows, the extra rows repeat earlier ones (a repeated row writes
    the very same values). O(size x width): a pool of tiny blocks can hold tens of millions."""
    num_blocks, width, bs, dev = layout.scratch_block, layout.blocks_per_seq, spec.block_size, spec.device
    distinct = min(size, num_blocks)
    readable = num_blocks - distinct  # blocks no row writes
    max_ctx = width * bs if readable else bs  # no block to read from: stay inside the own block
    ctx = torch.randint(1, max_ctx + 1, (distinct,), device=dev)
    pos = ctx - 1
    first = torch.randint(0, num_blocks, (1,), device=dev)
    own = (first + torch.arange(distinct, device=dev)) % num_blocks  # [distinct], all different
    tables = (first + distinct + torch.randint(0, max(readable, 1), (distinct, width), device=dev)) % num_blocks
    tables.scatter_(1, (pos // bs)[:, None], own[:, None])
    ids = torch.randint(0, spec.model_config.vocab_size, (distinct,), device=dev)
    repeat = torch.arange(size, device=dev) % distinct
    return {"batch": layout.pack(ids[repeat], pos[repeat], tables[repeat])}
