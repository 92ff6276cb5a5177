"""Pure-torch paged attention: the correctness oracle and the CPU path.

Runs on CPU and GPU with plain torch ops. It favours clarity over speed (decode gathers a sequence's
blocks into a dense tensor), so the Triton backend is tested against it, not the other way round. It is
also the CPU decode path, so there decode gathers only the blocks the longest sequence holds, not the
whole max_model_len window of the block table. Scores and softmax are computed in float32 whatever the
model dtype. An FP8 cache (--kv-cache-dtype fp8) holds K and V rounded to E4M3, clamped to 448 first as the Triton
kernels' kv_to_cache does (torch's own conversion saturates in some versions and in others makes NaN of what rounds
past 448), and they are read back in float32 as every other cache.

batch_invariant (--batch-invariant on the torch path): every query row, of a prefill or a decode, is attended
alone by `attend_row`, over exactly the keys it sees: each op's shapes then depend on that row's position only, so
its result is the same bits whatever the batch, the padding, the chunking or a cached prefix, and a decode row
equals the same position computed by prefill. Not CUDA-graph safe (the lengths are read on the host).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ostinato.attention.base import AttentionBackend, AttentionMetadata


def _bytes_if_fp8(cache: torch.Tensor) -> torch.Tensor:
    """The cache as uint8 where it holds FP8 (torch's CPU index ops take no float8; a byte is a byte), else itself."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


def _as_stored(new: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """K or V as a cache of cache_dtype stores it: FP8 clamped to its largest finite value, then rounded (the
    module's docstring says why the clamp)."""
    if cache_dtype == torch.float8_e4m3fn:
        fp8_max = torch.finfo(cache_dtype).max
        return new.float().clamp(-fp8_max, fp8_max).to(cache_dtype)
    return new.to(cache_dtype)


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache.index_select(0, blocks), in the cache's dtype."""
    return _bytes_if_fp8(cache).index_select(0, blocks).view(cache.dtype)


def held_blocks(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """The block-table columns that some row's context reaches, where the lengths live on the host.

    Why only there: on a GPU the longest length is a device-to-host sync, and inside a CUDA-graph
    capture the width it picks would be baked into the graph; so there the whole window is read and the
    mask alone hides what lies past each context. On the CPU a decode step would otherwise read (and
    score) max_model_len tokens per row whatever the context, which dominates a small model's step.
    """
    if block_tables.device.type != "cpu" or context_lens.numel() == 0:
        return block_tables
    width = -(-int(context_lens.max()) // block_size)
    return block_tables[:, :max(width, 1)]


class TorchRefBackend(AttentionBackend):
    """Reference implementation of `AttentionBackend` (see attention/base.py for the cache layout).

    `decode` is CUDA-graph safe on a GPU: every shape comes from tensor shapes (block table width, not the
    context lengths), masking is arithmetic, and nothing reads a tensor value on the host. On the CPU
    (no graphs; reading a tensor is free) it trims the block table to the longest context first.
    """

    name = "torch"

    def __init__(self, batch_invariant: bool = False):
        self.batch_invariant = batch_invariant

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        # k, v: [num_tokens, num_kv_heads, head_dim]; caches viewed as [num_slots, num_kv_heads, head_dim].
        # index_copy_ is a device-side scatter: no host sync, so it is safe inside a CUDA graph. Padded
        # decode rows all target scratch-block slots; which duplicate wins there does not matter.
        for cache, new in ((k_cache, k), (v_cache, v)):
            _bytes_if_fp8(cache).flatten(0, 1).index_copy_(0, slot_mapping, _bytes_if_fp8(_as_stored(new, cache.dtype)))

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if self.batch_invariant:
            return self._decode_rows(q, k_cache, v_cache, meta, scale)
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        block_tables = held_blocks(meta.block_tables, meta.context_lens, k_cache.shape[1])  # [num_seqs, W]
        # Gather each sequence's pages into one dense context: [num_seqs, W * block_size, Hkv, D].
        keys = gather_blocks(k_cache, block_tables.flatten()).view(num_seqs, -1, num_kv_heads, head_dim)
        values = gather_blocks(v_cache, block_tables.flatten()).view(num_seqs, -1, num_kv_heads, head_dim)

        # Query head h reads kv head h // group: [num_seqs, Hkv, group, D].
        q_grouped = q.float().view(num_seqs, num_kv_heads, group, head_dim)
        scores = torch.einsum("bhgd,bshd->bhgs", q_grouped, keys.float()) * scale  # [B, Hkv, group, S]

        # Positions at or past context_lens are stale or foreign data. A large finite negative (not
        # -inf) keeps a row with context_len 0 (possible in padding) finite instead of NaN.
        positions = torch.arange(keys.shape[1], device=q.device)  # [S]
        invalid = positions[None, :] >= meta.context_lens[:, None]  # [B, S]
        scores = scores.masked_fill(invalid[:, None, None, :], torch.finfo(torch.float32).min)
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bhgs,bshd->bhgd", probs, values.float())  # [B, Hkv, group, D]
        return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        num_heads = q.shape[1]
        num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
        group = num_heads // num_kv_heads
        # Prefill runs eager, so host-side lengths are fine; fall back to the tensors if not given.
        query_lens = meta.query_lens if meta.query_lens is not None else \
            (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).tolist()
        context_lens = meta.context_lens_host if meta.context_lens_host is not None else \
            meta.context_lens.tolist()

        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [num_tokens, H, D]
        if self.batch_invariant:
            return self._prefill_rows(q, out, k_cache, v_cache, meta, scale, query_lens, context_lens)
        # The sequences' rows start at query_start_loc[0]: 0, or past a mixed step's decode rows.
        start = int(meta.query_start_loc[0]) if meta.decode_rows is not None else 0
        for seq, (query_len, context_len) in enumerate(zip(query_lens, context_lens)):
            num_blocks = -(-context_len // block_size)
            blocks = meta.block_tables[seq, :num_blocks]
            # The whole context read back from the cache (cached prefix + this step's writes).
            keys = gather_blocks(k_cache, blocks).flatten(0, 1)[:context_len]  # [C, Hkv, D]
            values = gather_blocks(v_cache, blocks).flatten(0, 1)[:context_len]
            # SDPA wants [heads, len, D]; repeat kv heads so the memory-efficient kernel can run (GQA).
            keys = keys.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [H, C, D]
            values = values.float().transpose(0, 1).repeat_interleave(group, dim=0)
            queries = q[start:start + query_len].float().transpose(0, 1)  # [H, Q, D]

            # Query i sits at position context_len - query_len + i and sees keys 0..that position.
            query_pos = torch.arange(context_len - query_len, context_len, device=q.device)
            key_pos = torch.arange(context_len, device=q.device)
            allowed = key_pos[None, :] <= query_pos[:, None]  # [Q, C]
            attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=allowed, scale=scale)
            out[start:start + query_len] = attn.transpose(0, 1).to(q.dtype)
            start += query_len
        return out

    def _decode_rows(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.zeros_like(q)  # a row of context 0 (padding) gets zeros
        for seq, context_len in enumerate(meta.context_lens.tolist()):
            if context_len > 0:
                out[seq] = attend_row(q[seq], k_cache, v_cache, meta.block_tables[seq], context_len, scale)
        return out

    def _prefill_rows(self, q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, query_lens: list[int],
                      context_lens: list[int]) -> torch.Tensor:
        start = int(meta.query_start_loc[0]) if meta.decode_rows is not None else 0
        for seq, (query_len, context_len) in enumerate(zip(query_lens, context_lens)):
            for i in range(query_len):  # query i sits at position context_len - query_len + i
                out[start + i] = attend_row(q[start + i], k_cache, v_cache, meta.block_tables[seq],
                                            context_len - query_len + i + 1, scale)
            start += query_len
        return out


def attend_row(q_row: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
               num_keys: int, scale: float) -> torch.Tensor:
    """One query row [H, D] over the first num_keys tokens of its sequence (block_table [W]) -> [H, D], in float32:
    every shape here is set by num_keys, so the row's arithmetic is the same in any batch (batch_invariant)."""
    num_heads, head_dim = q_row.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    blocks = block_table[:-(-num_keys // block_size)]
    keys = gather_blocks(k_cache, blocks).flatten(0, 1)[:num_keys].float().permute(1, 2, 0)  # [Hkv, D, C]
    values = gather_blocks(v_cache, blocks).flatten(0, 1)[:num_keys].float().transpose(0, 1)  # [Hkv, C, D]
    q = q_row.float().view(num_kv_heads, num_heads // num_kv_heads, head_dim)  # query head h reads h // group
    probs = torch.softmax(torch.matmul(q, keys.contiguous()) * scale, dim=-1)  # [Hkv, group, C]
    return torch.matmul(probs, values.contiguous()).reshape(num_heads, head_dim).to(q_row.dtype)
