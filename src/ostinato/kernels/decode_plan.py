"""Host-side plan of the split-KV decode (kernels/decode_attention.py): its launch settings, the split count
per shape, what it needs to apply RoPE itself, and the single launch's arrival counters. Everything here is
decided from shapes before a CUDA graph is captured."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from ostinato.errors import ConfigError


@dataclass(frozen=True)
class DecodeTuning:
    """Launch settings of the decode kernels. The defaults were the fastest of two sweeps at batch 1, 16, 64:
    the kernel alone (block_n 32/64, num_stages 1/3, programs_per_sm 2/4), then whole decode steps (block_n
    16-128, 2-8 warps, forced split counts); the figures are in docs/PERFORMANCE.md, "Why these defaults".
    Warps and stages differ between split and unsplit launches (below).

    block_n: tokens per inner-loop tile (a power of two >= 16).
    programs_per_sm: split into as many slices as keep num_seqs * num_kv_heads * splits within this many
        programs per SM (rounded down, so that they all fit on the GPU at once: rounding up gave batch 16 with 8
        kv heads 5 slices, 640 programs where 528 fit, and a second wave, measurably slower).
    max_splits: at most this many slices (bounds the merge's work and the partials' memory).
    max_keys_per_program: split a table wider than this many tokens at any batch (a long sequence's scan
    must not set the step's time; choose_num_splits).
    splits: force this split count for every shape (tests, measurements); None chooses per shape.
    apply_rope: the decoder's Triton path may hand decode the qkv projection itself (decode_with_rope: q/k
        norm, RoPE and the K/V write in this kernel, one launch fewer per layer); False keeps the q/k-norm +
        RoPE kernel before it. benchmarks/kernels/decode_attention.py --rope times both.
    pdl: launch with programmatic dependent launch (kernels/pdl.py): the kernel may start while the projection before
        it finishes. Only where pdl.resolve_pdl says the device supports it; the runner sets it from --pdl.
    num_warps, num_stages: those of a launch that does not split the context (a batch that fills the GPU).
        2 warps rather than 4 were faster on head_dim 128 at large batches and a tie on head_dim 64.
    late_trigger_programs: with pdl, where the launch holds at least this many active programs (num_seqs x
        kv heads x the slices holding tokens, which each program estimates from its own sequence), each program
        lets the next kernel launch (griddepcontrol.launch_dependents) only once it has walked its slice;
        where fewer, first thing. Why: a trigger first thing in a launch whose programs fill the GPU lets o_proj
        launch at once, and its few programs then sit, and run, on the few SMs with room; a small launch
        (batch 1 at 512 tokens) is better off triggering early. 0: always after the loop.
    split_num_warps: num_warps of a launch that splits (2 instead of 4 were slower at batch 1).
    merge_chunk_elems: fp32 partial-output elements the single launch's merge loads per round trip to L2
        ([group, slices, head_dim] tiles); a merge of more slices than one chunk loops, one round trip a chunk.
        Batch 1 at a context of 4096 or more runs 64 slices, 8 round trips at 4096 elements (group 4, head_dim
        128) and 4 at 8192. Fewer round trips win at long contexts and cost a few registers at short ones;
        16384 spills.
    merge_tile_for_max_splits: size every split launch's merge tile (SPLITS_PAD, MERGE_CHUNK) for max_splits
        rather than for its own split count, lanes past the split count masked. The split count then changes
        no compile-time constant, so a shape's split launches share one compiled kernel, where each split count
        otherwise compiles its own (a capture up to batch 64 of the 8B compiled six; with it, three). On: a
        launch of few splits (8 at a 512-token context) took as long with the wider tile within a few percent
        either way, on both shapes measured (docs/PERFORMANCE.md, "Why these defaults").
    quantize_output: with apply_rope, where o_proj reads its input quantized to int8 (a GGUF projection at the rows
        that take integer dot products), the decode writes it so (kernels/decode_output.py) and o_proj's own
        quantizing launch goes, and o_proj's first weight tiles overlap the attention instead of that launch. On:
        the 8B's Q4_K_M one-row step 2% faster, 8 rows within 1% (docs/PERFORMANCE.md, GGUF).
    split_num_stages: num_stages of a launch that splits the context to fill idle SMs (launch_for).
        Such a launch is one whose batch leaves SMs idle, so its programs walk few tiles and the step waits
        on their latency; software pipelining then only adds a prologue. An unsplit launch, whose programs walk
        many tiles, loses with 1 stage and keeps 3.
    Measurements behind every default: docs/PERFORMANCE.md, "Why these defaults".
    """

    block_n: int = 64
    num_warps: int = 2
    num_stages: int = 3
    programs_per_sm: int = 4
    max_splits: int = 64
    max_keys_per_program: int = 2048
    splits: int | None = None
    apply_rope: bool = True
    pdl: bool = False
    late_trigger_programs: int = 128
    split_num_warps: int = 4
    split_num_stages: int = 1
    merge_chunk_elems: int = 8192
    merge_tile_for_max_splits: bool = True
    quantize_output: bool = True

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ConfigError(f"decode block_n must be a power of two >= 16, got {self.block_n}")
        for name in ("num_warps", "num_stages", "split_num_warps", "split_num_stages", "programs_per_sm", "max_splits",
                     "max_keys_per_program", "merge_chunk_elems"):
            if getattr(self, name) < 1:
                raise ConfigError(f"decode {name} must be >= 1, got {getattr(self, name)}")
        if self.splits is not None and self.splits < 1:
            raise ConfigError(f"decode splits must be >= 1 or None, got {self.splits}")
        if self.late_trigger_programs < 0:
            raise ConfigError(f"decode late_trigger_programs must be >= 0, got {self.late_trigger_programs}")

    def merge_slices(self, splits: int) -> int:
        """The slice count a launch of `splits` slices sizes its merge tile for (merge_tile_for_max_splits)."""
        return max(splits, self.max_splits) if self.merge_tile_for_max_splits and splits > 1 else splits

    def launch_for(self, splits: int, batch_programs: int, num_sms: int) -> tuple[int, int]:
        """(num_warps, num_stages) of a launch of `splits` slices whose batch alone makes `batch_programs`
        programs (sequences x kv heads): the split settings only where the split fills idle SMs. A batch that
        fills the GPU and splits only so that no program scans more than max_keys_per_program (a table wider
        than 2048 tokens) walks long slices as an unsplit launch does, and keeps its settings (faster on
        `ostinato bench throughput`, where a 4096-token table splits in 2 at every batch)."""
        if splits > 1 and batch_programs < num_sms:
            return self.split_num_warps, self.split_num_stages
        return self.num_warps, self.num_stages


# --batch-invariant: every decode launch splits each row's context into this many slices, whatever the batch.
INVARIANT_DECODE_SPLITS = 16


def invariant_decode_tuning(tuning: DecodeTuning) -> DecodeTuning:
    """The decode settings under --batch-invariant. A slice spans cdiv(context, splits) tokens rounded up to
    block_n, read from the row's own context length in the kernel; with the split count fixed, a row's slice
    boundaries, its partials and the merge (all slices in slice order, over a tile set by the split count) are
    the same in any batch. Split and unsplit launches keep one warp count (the layout sets a reduction's order).
    RoPE stays in its own kernel (apply_rope off): a mixed step's decode rows take that kernel and the plain
    decode, so a pure decode step must too, or a row's q and k would be computed two ways. The merge tile is
    sized for the fixed split count itself: one split count compiles one kernel anyway, and the merge's bits
    are the ones the GPU invariance tests checked."""
    return replace(tuning, splits=INVARIANT_DECODE_SPLITS, num_warps=tuning.split_num_warps,
                   num_stages=tuning.split_num_stages, apply_rope=False, merge_tile_for_max_splits=False)


def _ceil_div(a: int, b: int) -> int:
    # triton.cdiv's arithmetic, without importing triton: this plan is host-side, and CPU installs have no triton.
    return -(-a // b)


def choose_num_splits(tuning: DecodeTuning, num_seqs: int, num_kv_heads: int, max_context: int,
                      num_sms: int) -> int:
    """Slices per sequence for a decode launch; shapes only (see the module docstring)."""
    if tuning.splits is not None:
        return tuning.splits
    programs = max(1, num_seqs * num_kv_heads)
    # One long sequence among short ones: unsplit, its programs scan its whole context while the rest of the
    # GPU idles, and the step waits for them (32 short rows beside one of 8192 tokens: milliseconds a step).
    # So no program gets more than max_keys_per_program keys of the widest context
    # the table holds, even when the batch alone fills the GPU.
    straggler = _ceil_div(max(max_context, 1), tuning.max_keys_per_program)
    if programs >= num_sms:
        return max(1, min(straggler, tuning.max_splits))
    wanted = max(tuning.programs_per_sm * num_sms // programs, straggler)  # all resident at once (DecodeTuning)
    useful = _ceil_div(max(max_context, 1), tuning.block_n)  # more slices than tiles would all be empty
    return max(1, min(wanted, useful, tuning.max_splits))


@functools.lru_cache(maxsize=None)
@dataclass(frozen=True)
class DecodeRope:
    """What the decode kernel needs to apply (Qwen3: per-head RMSNorm, then) RoPE itself and write the new
    token's K/V: q_weight, k_weight [D] or both None; cos_sin_cache [max_positions, 2D] (cos | signed sin);
    positions [num_seqs] (the new token's); slot_mapping [num_seqs] (where its K/V goes; < 0: nowhere)."""

    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    cos_sin_cache: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    eps: float


