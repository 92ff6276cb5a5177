"""Triton attention over the paged KV cache: K/V write, split-KV decode, varlen causal prefill.

Memory layout (attention/base.py)
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], last dim contiguous, both with the
    same strides. Token t of sequence s lives in block block_tables[s, t // block_size] at offset
    t % block_size; slot = block * block_size + offset. q/k/v may be strided views (e.g. slices of a fused
    qkv projection) as long as head_dim is contiguous.

Algorithm
    write_kv   one program per token copies its [num_kv_heads, head_dim] K and V rows to their slot.
               Negative slots are skipped (the vLLM convention for padding), so a runner may use either a
               sentinel slot or the scratch block for padded rows. The decoder's Triton kernel set skips
               this launch: its q/k-norm + RoPE kernel writes K/V itself (accepts_fused_kv_write).
               Kernel: kernels/paged_kv_write.py.
    decode     split-KV flash-decoding, GQA-aware, split count chosen per shape, partials merged by the last
               slice to finish (one launch): kernels/decode_attention.py.
    prefill    varlen flash attention. Grid (cdiv(max_query_len, BLOCK_Q), num_seqs, num_kv_heads); a
               program takes BLOCK_Q new tokens of one sequence times its GROUP query heads as the rows of
               one tile, and scans the sequence's cache from position 0 up to its last query, with the
               causal mask key_pos <= query_pos where query i of a sequence with context C and Q new tokens
               sits at position C - Q + i. So an already-cached prefix (prefix caching, chunked prefill,
               recompute after preemption) is read from the cache like any other token: kernels/prefill_one_pass.py.
               When those programs are too few to fill the GPU and the context is long (a short chunk of a
               chunked prefill), prefill instead splits each program's key range over several programs:
               kernels/prefill_attention.py (when: kernels/prefill_plan.py).

Limits
    head_dim: any size; tiles are padded to the next power of two >= 16 (64 and 128 need no padding).
    block_size: any positive integer (powers of two are what the engine uses).
    num_heads must be a multiple of num_kv_heads. fp32, bf16 and fp16; fp32 dots run in IEEE precision
    (not TF32) so fp32 results match the torch reference tightly.
    Triton compiles each kernel on its first call: run decode once before capturing a CUDA graph (the
    runner's warm-up does) so that compilation happens outside the capture.
    context_lens[s] must not exceed W * block_size (the runner guarantees it); a row with context 0 gets
    zeros, never NaN.
    Prefill tiles (TritonAttentionTuning) were chosen so bf16/fp16 kernels at head_dim 64/128, GQA 1-8 compile
    for sm_90 (triton 3.9, read back with cuobjdump) with no or tiny register spills; not benchmark-tuned. fp32
    prefill spills at the default tile (fp32 is the correctness path, not the fast one).
    Under TRITON_INTERPRET=1 (CPU tests) bf16 dots multiply in fp32 after the same rounding, because the
    interpreter's bf16 tl.dot multiplies raw bit patterns (triton 3.9).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ostinato.errors import ConfigError
from ostinato.attention.base import AttentionBackend, AttentionMetadata
from ostinato.kernels.prefill_plan import PrefillSplitTuning
from ostinato.kernels.decode_plan import invariant_decode_tuning
from ostinato.kernels.attention_common import check_inputs, contiguous_last, group_size
from ostinato.kernels.paged_kv_write import paged_write_kv
from ostinato.kernels.prefill_one_pass import paged_prefill_one_pass
from ostinato.kernels.decode_attention import DecodeRope, DecodeTuning, SplitCounters, paged_decode
from ostinato.kernels.prefill_attention import paged_prefill_split, plan_for


@dataclass(frozen=True)
class TritonAttentionTuning:
    """Tile sizes and launch settings. `decode`: see kernels/decode_attention.py. The prefill defaults avoid
    register spills for bf16/fp16 at head_dim 128 on sm_90 (checked with cuobjdump -res-usage); they are
    not benchmark-tuned."""

    decode: DecodeTuning = field(default_factory=DecodeTuning)
    prefill_block_m: int = 64  # rows per prefill program: queries x (query heads per kv head)
    prefill_block_n: int = 32
    prefill_num_warps: int = 4
    prefill_split: PrefillSplitTuning = field(default_factory=PrefillSplitTuning)  # kernels/prefill_plan.py
    batch_invariant: bool = False  # set by batch_invariant_tuning

    def __post_init__(self) -> None:
        for name in ("prefill_block_m", "prefill_block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ConfigError(f"{name} must be a power of two >= 16, got {value}")
        if self.prefill_num_warps < 1:
            raise ConfigError(f"prefill_num_warps must be >= 1, got {self.prefill_num_warps}")


def batch_invariant_tuning(tuning: TritonAttentionTuning) -> TritonAttentionTuning:
    """The settings under --batch-invariant. Decode: a fixed split count (kernels/decode_plan.py,
    invariant_decode_tuning). Prefill: never split, so every query row runs the one-pass kernel, which walks its
    keys from position 0 in prefill_block_n tiles and masks the keys past the row's own position: tiles past it
    add exact zeros (weight 1, sum + 0), so the row's result is the same whatever the chunk it came in, the
    batch, or whether its prefix was cached."""
    return replace(tuning, decode=invariant_decode_tuning(tuning.decode),
                   prefill_split=replace(tuning.prefill_split, splits=1), batch_invariant=True)


class TritonPagedBackend(AttentionBackend):
    """Paged attention in Triton; see the module docstring for the algorithm, layout and limits."""

    name = "triton"
    accepts_fused_kv_write = True  # write_kv is then skipped on the Triton kernel set's path

    def __init__(self, tuning: TritonAttentionTuning | None = None):
        self.tuning = tuning or TritonAttentionTuning()
        self.pdl = self.tuning.decode.pdl
        self.batch_invariant = self.tuning.batch_invariant
        self.split_counters = SplitCounters()  # the single-launch decode's workspace, shared by all layers

    # ---- K/V write -------------------------------------------------------------------------------------

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        # k, v: [num_tokens, num_kv_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim]
        paged_write_kv(k, v, k_cache, v_cache, slot_mapping)

    # ---- decode ----------------------------------------------------------------------------------------

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [num_seqs, num_heads, head_dim] -> out: [num_seqs, num_heads, head_dim]
        check_inputs(q, k_cache, v_cache)
        group = group_size(q.shape[1], k_cache.shape[2])
        block_tables, context_lens = meta.block_tables, meta.context_lens  # [num_seqs, W], [num_seqs]
        assert block_tables.shape[0] == q.shape[0] and context_lens.shape == (q.shape[0],)
        return paged_decode(contiguous_last(q), k_cache, v_cache, block_tables, context_lens, scale, group,
                            self.tuning.decode, self.split_counters)

    @property
    def decode_applies_rope(self) -> bool:  # type: ignore[override]  # fixed by the tuning, before capture
        return self.tuning.decode.apply_rope

    def decode_quantizes_output(self, head_dim: int) -> bool:
        # A kv head's query heads are then whole 32-blocks of the output row (kernels/decode_output.py).
        return self.decode_applies_rope and self.tuning.decode.quantize_output and head_dim >= 32 \
            and head_dim & (head_dim - 1) == 0

    def decode_with_rope(self, heads: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                         cos_sin_cache: torch.Tensor, positions: torch.Tensor, eps: float, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                         quantized: object | None = None) -> torch.Tensor:
        # heads: [num_seqs, H + 2Hkv, D], the qkv projection -> out: [num_seqs, H, D]
        check_inputs(heads, k_cache, v_cache)
        num_kv_heads = k_cache.shape[2]
        group = group_size(heads.shape[1] - 2 * num_kv_heads, num_kv_heads)
        block_tables, context_lens = meta.block_tables, meta.context_lens  # [num_seqs, W], [num_seqs]
        assert block_tables.shape[0] == heads.shape[0] and context_lens.shape == (heads.shape[0],)
        rope = DecodeRope(q_weight, k_weight, cos_sin_cache, positions, meta.slot_mapping, eps)
        return paged_decode(contiguous_last(heads), k_cache, v_cache, block_tables, context_lens, scale, group,
                            self.tuning.decode, self.split_counters, rope, quantized)

    # ---- prefill ---------------------------------------------------------------------------------------

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim], sequences back to back per query_start_loc -> same shape
        check_inputs(q, k_cache, v_cache)
        assert meta.query_start_loc is not None, "prefill needs meta.query_start_loc"
        # The grid comes from max_query_len: one too small would leave rows of `out` unwritten.
        assert meta.query_lens is None or max(meta.query_lens, default=0) <= meta.max_query_len
        group = group_size(q.shape[1], k_cache.shape[2])
        q = contiguous_last(q)
        # A short chunk over a long context: too few (query block, kv head) programs to fill the GPU, so
        # split the key range (kernels/prefill_attention.py). The plan uses the step's host figures when
        # meta has them, else shapes only (a captured prefill: leave query_lens / context_lens_host None).
        plan = plan_for(self.tuning.prefill_split, q, k_cache, meta, group)
        if plan.splits > 1:
            return paged_prefill_split(q, k_cache, v_cache, meta, scale, group, self.tuning.prefill_split, plan)
        return paged_prefill_one_pass(q, k_cache, v_cache, meta, scale, group, plan, self.tuning.prefill_block_m,
                                      self.tuning.prefill_block_n, self.tuning.prefill_num_warps)
