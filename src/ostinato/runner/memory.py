"""GPU memory arithmetic for the KV cache and the CUDA graphs, as pure functions (no torch).

How start-up spends the GPU (every figure in bytes):

    budget   = total_bytes * gpu_memory_utilization
    kv_bytes = budget - weights - activation peak - CUDA-graph estimate
    blocks   = kv_bytes // block_bytes, of which `reserved_blocks` (the padding scratch block) are kept
               from the scheduler; the rest are the usable `num_blocks`.

CUDA-graph memory competes with the KV cache: every byte the graph pool keeps is a byte of context the
scheduler cannot hand out. `graph_memory_report` states that trade in KV blocks and tokens so the user can
decide whether --max-cuda-graph-size / --cuda-graph-sizes / --enforce-eager are worth changing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from ostinato.errors import ConfigError, OutOfKVCacheError

MiB = 1 << 20
GiB = 1 << 30

# The flags that move memory between the KV cache and the CUDA graphs, named in every message about it.
_FREE_MEMORY_HINT = (
    "raise --gpu-memory-utilization, shrink CUDA-graph memory with a lower --max-cuda-graph-size or fewer "
    "--cuda-graph-sizes, or turn CUDA graphs off with --enforce-eager"
)


def _gib(n: int | float) -> str:
    return f"{n / GiB:.2f} GiB"


def _mib(n: int | float) -> str:
    return f"{n / MiB:.1f} MiB"


def kv_block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype_bytes: int) -> int:
    """Bytes one KV block takes across all layers, K and V together.

    Per layer a block holds K and V, each [block_size, num_kv_heads, head_dim] of `dtype_bytes` elements.
    """
    for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                        ("block_size", block_size), ("dtype_bytes", dtype_bytes)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes


def kv_token_bytes(mc, dtype_bytes: int) -> int:
    """Bytes one token's K and V take across all layers of a model (mc: a ModelConfig), at dtype_bytes a value."""
    return kv_block_bytes(mc.num_layers, mc.num_kv_heads, mc.head_dim, 1, dtype_bytes)


@dataclass(frozen=True)
class KVCachePlan:
    """How many KV blocks fit, and what the CUDA graphs cost in blocks. Sizes in bytes."""

    total_bytes: int  # the device's memory
    budget_bytes: int  # total_bytes * gpu_memory_utilization
    weights_bytes: int
    activation_peak_bytes: int
    graph_estimate_bytes: int
    kv_bytes: int  # budget - weights - activation peak - graph estimate
    block_bytes: int
    block_size: int
    max_model_len: int
    num_blocks: int  # usable blocks, handed to the scheduler (CacheConfig.num_blocks)
    reserved_blocks: int  # allocated beside them, never scheduled (the padding scratch block)
    graph_blocks: int  # usable blocks the graph estimate displaces (what --enforce-eager would add)

    @property
    def num_tokens(self) -> int:
        """Tokens of context the usable blocks hold."""
        return self.num_blocks * self.block_size

    @property
    def blocks_per_seq(self) -> int:
        """Blocks one sequence at max_model_len needs."""
        return math.ceil(self.max_model_len / self.block_size)

    @property
    def max_full_length_seqs(self) -> int:
        """Sequences at max_model_len that fit at once."""
        return self.num_blocks // self.blocks_per_seq

    @property
    def pool_bytes(self) -> int:
        """Bytes the runner allocates for the KV pool (usable + reserved blocks)."""
        return (self.num_blocks + self.reserved_blocks) * self.block_bytes

    def summary(self) -> str:
        """One log line: what the KV cache got and what the graphs cost it."""
        return (
            f"KV cache: {self.num_blocks} blocks of {self.block_size} tokens = {self.num_tokens} tokens "
            f"({_gib(self.pool_bytes)}; {self.max_full_length_seqs} sequences at max_model_len "
            f"{self.max_model_len}); budget {_gib(self.budget_bytes)} - weights {_gib(self.weights_bytes)} "
            f"- activations {_gib(self.activation_peak_bytes)} - CUDA graphs {_gib(self.graph_estimate_bytes)} "
            f"(= {self.graph_blocks} KV blocks)"
        )


def plan_kv_cache(
    total_bytes: int,
    gpu_memory_utilization: float,
    weights_bytes: int,
    activation_peak_bytes: int,
    graph_estimate_bytes: int,
    block_bytes: int,
    block_size: int,
    max_model_len: int,
    reserved_blocks: int = 1,
) -> KVCachePlan:
    """Split the memory budget into KV blocks once weights, activations and CUDA graphs are paid for.

    The KV pool gets `budget - weights - activation peak - graph estimate` bytes, where
    `budget = total_bytes * gpu_memory_utilization`. `reserved_blocks` of those blocks (the scratch block
    padded decode rows write into) are not handed to the scheduler.

    Raises OutOfKVCacheError when no usable block is left, or when the usable blocks hold less than one
    sequence at max_model_len (the message names the largest --max-model-len that fits).
    """
    if total_bytes <= 0:
        raise ValueError(f"total_bytes must be > 0, got {total_bytes}")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
    for name, value in (("weights_bytes", weights_bytes), ("activation_peak_bytes", activation_peak_bytes),
                        ("graph_estimate_bytes", graph_estimate_bytes), ("reserved_blocks", reserved_blocks)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    for name, value in (("block_bytes", block_bytes), ("block_size", block_size),
                        ("max_model_len", max_model_len)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")

    budget = int(total_bytes * gpu_memory_utilization)
    without_graphs = budget - weights_bytes - activation_peak_bytes
    kv_bytes = without_graphs - graph_estimate_bytes
    num_blocks = max(0, kv_bytes // block_bytes - reserved_blocks)
    num_blocks_without_graphs = max(0, without_graphs // block_bytes - reserved_blocks)
    plan = KVCachePlan(
        total_bytes=total_bytes, budget_bytes=budget, weights_bytes=weights_bytes,
        activation_peak_bytes=activation_peak_bytes, graph_estimate_bytes=graph_estimate_bytes,
        kv_bytes=kv_bytes, block_bytes=block_bytes, block_size=block_size, max_model_len=max_model_len,
        num_blocks=num_blocks, reserved_blocks=reserved_blocks,
        graph_blocks=num_blocks_without_graphs - num_blocks,
    )

    breakdown = (
        f"budget {_gib(budget)} (--gpu-memory-utilization {gpu_memory_utilization} x {_gib(total_bytes)}) "
        f"- weights {_gib(weights_bytes)} - activation peak {_gib(activation_peak_bytes)} "
        f"- CUDA graphs {_gib(graph_estimate_bytes)} = {_gib(kv_bytes)} for the KV cache"
    )
    if num_blocks < 1:
        if num_blocks_without_graphs < 1:
            why = ("even without CUDA graphs nothing would be left: the weights and activations alone need "
                   f"{_gib(weights_bytes + activation_peak_bytes)} of the {_gib(budget)} budget")
        else:
            why = (f"without CUDA graphs (--enforce-eager) the cache would get {num_blocks_without_graphs} "
                   "blocks")
        raise OutOfKVCacheError(
            f"no room for the KV cache: {breakdown}, and one block needs {_mib(block_bytes)} "
            f"(plus {reserved_blocks} reserved); {why}. To fix: {_FREE_MEMORY_HINT}."
        )
    if num_blocks < plan.blocks_per_seq:
        raise OutOfKVCacheError(
            f"the KV cache holds {plan.num_tokens} tokens ({num_blocks} blocks of {block_size}), less than one "
            f"sequence at --max-model-len {max_model_len} ({breakdown}; CUDA graphs take {plan.graph_blocks} "
            f"blocks). Lower --max-model-len to {plan.num_tokens} or less, or free memory for the cache: "
            f"{_FREE_MEMORY_HINT}."
        )
    return plan


def graph_memory_report(
    per_size_bytes: Mapping[int, int],
    estimate_bytes: int,
    block_bytes: int,
    block_size: int,
    max_model_len: int,
    what: str = "CUDA graphs",
    unit: str = "size",
) -> str:
    """A table of the memory each captured graph added (largest size first, the capture order), the total,
    the estimate it was budgeted with, and what the total costs in KV cache:

        CUDA graphs use X GiB = N KV blocks = T tokens of context (M sequences at max_model_len)

    per_size_bytes maps batch size to the bytes its capture added (later captures reuse the shared pool,
    so small sizes usually add little). Negative readings (memory freed meanwhile) count as 0. `what` and
    `unit` name the graphs and their size (the prefill graphs: "prefill graphs", "tokens").
    """
    if block_bytes < 1 or block_size < 1 or max_model_len < 1:
        raise ValueError("block_bytes, block_size and max_model_len must be >= 1")
    if not per_size_bytes:
        return f"{what}: none captured (eager); they use no memory."
    lines = [f"{what} memory (capture order, largest first):", f"  {unit:>6}  {'incremental MiB':>16}"]
    total = 0
    for size in sorted(per_size_bytes, reverse=True):
        used = max(0, per_size_bytes[size])
        total += used
        lines.append(f"  {size:>6}  {used / MiB:>16.1f}")
    lines.append(f"  {'total':>6}  {total / MiB:>16.1f}")
    if estimate_bytes > 0:
        lines.append(f"estimate {_mib(estimate_bytes)}, actual {_mib(total)} "
                     f"({100.0 * total / estimate_bytes:.0f}% of the estimate)")
    else:
        lines.append(f"no estimate was budgeted; actual {_mib(total)}")
    blocks = math.ceil(total / block_bytes)
    tokens = blocks * block_size
    lines.append(
        f"{what} use {total / GiB:.3f} GiB = {blocks} KV blocks = {tokens} tokens of context "
        f"({tokens / max_model_len:.2f} sequences at max_model_len {max_model_len})"
    )
    return "\n".join(lines)


def capture_oom_message(size: int, cause: str) -> str:
    """What to tell the user when the GPU ran out of memory while capturing the graph for `size`."""
    return (
        f"out of GPU memory while capturing the CUDA graph for batch size {size} ({cause}). CUDA graphs need "
        "memory beside the weights and the KV cache: lower --gpu-memory-utilization to leave more of the GPU "
        "to them, capture fewer or smaller graphs with --max-cuda-graph-size or --cuda-graph-sizes, or run "
        "without graphs with --enforce-eager."
    )
