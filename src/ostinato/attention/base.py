"""The attention-backend interface shared by the pure-torch reference and the Triton backend.

KV cache layout, per layer: k_cache and v_cache, each [num_slots_blocks, block_size, num_kv_heads, head_dim].
The pool has one extra block at index `scratch_block` (== number of usable blocks) that the scheduler never
hands out: padded decode rows write their K/V there and read it, so a CUDA graph needs no masks and no
page address is baked in (which pages a sequence uses is data: block_tables).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ostinato.kernels.attention_metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata"]


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache and computes attention over it.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].
    GQA: query head h reads kv head h // (num_heads // num_kv_heads).
    decode() must be CUDA-graph safe: no host sync, shapes fixed by the tensors' shapes only.
    """

    name: str = "base"
    # True when K/V may reach the cache without write_kv: the decoder's kernel set then writes them from
    # its q/k-norm + RoPE kernel, straight into this module's layout (kernels/fused.py,
    # qk_norm_rope_write_kv), one launch fewer per layer. The reference backend keeps its own write, so it
    # stays a whole oracle (write and attention).
    accepts_fused_kv_write: bool = False
    # True when decode_with_rope exists: decode straight from the qkv projection, q/k-norm + RoPE and the
    # K/V write inside the attention kernel (one launch for all three at decode).
    decode_applies_rope: bool = False
    # True when the decoder's Triton kernels launch with programmatic dependent launch (kernels/pdl.py, --pdl): set by
    # the Triton backend, whose decode kernel keeps PDL's contract; fixed before capture.
    pdl: bool = False
    # True under --batch-invariant: the backend reduces each query row in an order set by that row's own context
    # alone (docs/ARCHITECTURE.md, "Batch-invariant mode"); the decoder then picks the invariant kernel set.
    batch_invariant: bool = False

    @abstractmethod
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None: ...

    @abstractmethod
    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Causal attention of each sequence's new tokens over its whole cached context
        (an already-cached prefix included). Returns [num_tokens, num_heads, head_dim]."""

    @abstractmethod
    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """One query token per sequence over its context_lens[s] cached tokens. [num_seqs, H, D]."""

    def decode_quantizes_output(self, head_dim: int) -> bool:
        """Whether decode_with_rope takes `quantized` at this head_dim: the output written as the GGUF
        integer-dot kernels read their input (kernels/gguf_int8_dot.QuantizedX), for o_proj. Default: never."""
        return False

    def decode_with_rope(self, heads: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                         cos_sin_cache: torch.Tensor, positions: torch.Tensor, eps: float, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                         quantized: object | None = None) -> torch.Tensor:
        """decode() from the fused qkv projection heads [num_seqs, H + 2Hkv, D]: (with weights, per-head
        RMSNorm of q and k, then) RoPE at `positions`, the new K/V written at meta.slot_mapping, attention
        over context_lens tokens, the new one included. [num_seqs, H, D]. Only where decode_applies_rope.
        quantized (where decode_quantizes_output): the output goes there instead, and what comes back is
        unwritten."""
        raise NotImplementedError(f"the {self.name} attention backend does not apply RoPE in its decode")

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """The step's attention, after its K/V were written: prefill, decode, or a mixed step (prefill
        metadata whose `decode_rows` covers its first D token rows). A mixed step runs both kernels on the
        rows they own, with shapes fixed by the tensors (CUDA-graph safe): decode() on rows [0, D), prefill()
        on the sequences of query_start_loc (which start past the decode rows), and the decode rows' output
        is chosen where their context is not 0. Why not the prefill kernel for the decode rows: as one-token
        sequences they would take a sequence slot each, and the prefill kernels' grids grow with them."""
        if not meta.is_prefill:
            return self.decode(q, k_cache, v_cache, meta, scale)
        out = self.prefill(q, k_cache, v_cache, meta, scale)  # rows of no prefill sequence: left unwritten
        rows = meta.decode_rows
        if rows is None:
            return out
        d = rows.context_lens.shape[0]
        decoded = self.decode(q[:d], k_cache, v_cache, rows, scale)  # [D, H, Dh]
        out[:d] = torch.where((rows.context_lens > 0)[:, None, None], decoded, out[:d])
        return out
