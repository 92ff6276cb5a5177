"""Prefill over a prefix cached in blocks that several sequences share (prefix caching), and chunks that start
mid-block (chunked prefill): both attention backends against a dense float64 reference. The Triton kernel runs
under TRITON_INTERPRET=1 on CPU."""

import math

import pytest
import torch

from ostinato.attention.base import AttentionMetadata
from ostinato.attention.torch_ref import TorchRefBackend

BLOCK, KV_HEADS, GROUP, DIM = 16, 2, 2, 32


def _backends():
    out = [TorchRefBackend()]
    try:
        from ostinato.attention.triton_paged import TritonPagedBackend
        out.append(TritonPagedBackend())
    except ImportError:  # no triton here: the torch backend is still checked
        pass
    return out


@pytest.mark.parametrize("backend", _backends(), ids=lambda b: b.name)
def test_prefill_reads_shared_cached_blocks_and_mid_block_chunks(backend):
    gen = torch.Generator().manual_seed(0)
    # One token stream per sequence; A and B share their first 32 tokens, so the same two physical blocks.
    shared = torch.randn(32, 2, KV_HEADS, DIM, generator=gen, dtype=torch.float64)  # [tokens, k/v, heads, dim]
    own = [torch.randn(n, 2, KV_HEADS, DIM, generator=gen, dtype=torch.float64) for n in (5, 19, 23)]
    streams = [torch.cat([shared, own[0]]), torch.cat([shared, own[1]]), own[2]]  # A: 37, B: 51, C: 23 tokens
    # (tokens cached before this step, tokens of this step's chunk): A's whole tail after the shared prefix, a
    # chunk of B that starts and ends mid-block, a one-token chunk of C.
    steps = [(32, 5), (37, 7), (22, 1)]
    tables = [[0, 1, 2], [0, 1, 3, 4], [5, 6]]  # blocks 0 and 1 shared by A and B
    k_cache = torch.full((8, BLOCK, KV_HEADS, DIM), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))  # a read past a context shows as NaN
    for stream, table, (cached, n) in zip(streams, tables, steps):
        for p in range(cached + n):
            k_cache[table[p // BLOCK], p % BLOCK] = stream[p, 0].float()
            v_cache[table[p // BLOCK], p % BLOCK] = stream[p, 1].float()
    q = torch.randn(sum(n for _, n in steps), KV_HEADS * GROUP, DIM, generator=gen)
    query_lens = [n for _, n in steps]
    context_lens = [c + n for c, n in steps]
    width = max(map(len, tables))
    meta = AttentionMetadata(
        is_prefill=True, slot_mapping=torch.zeros(0, dtype=torch.int64),
        block_tables=torch.tensor([t + [7] * (width - len(t)) for t in tables], dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        query_start_loc=torch.tensor([0, 5, 12, 13], dtype=torch.int32), query_lens=query_lens,
        context_lens_host=context_lens, max_query_len=max(query_lens), max_context_len=max(context_lens))
    k_cache[7] = 0.0  # the padding block of the tables: finite, never read within a context
    v_cache[7] = 0.0
    out = backend.prefill(q, k_cache, v_cache, meta, 1 / math.sqrt(DIM))

    start = 0
    for stream, (cached, n) in zip(streams, steps):
        ctx = cached + n
        keys = stream[:ctx, 0].repeat_interleave(GROUP, dim=1)  # [ctx, heads, dim]
        values = stream[:ctx, 1].repeat_interleave(GROUP, dim=1)
        qs = q[start:start + n].double()
        scores = torch.einsum("qhd,khd->hqk", qs, keys) / math.sqrt(DIM)
        visible = torch.arange(ctx)[None, :] <= torch.arange(cached, ctx)[:, None]  # causal from position cached
        scores = scores.masked_fill(~visible, float("-inf"))
        expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
        torch.testing.assert_close(out[start:start + n].double(), expected, atol=2e-5, rtol=2e-5)
        start += n
