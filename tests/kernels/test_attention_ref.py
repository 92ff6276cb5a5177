"""TorchRefBackend against dense float64 attention, over shuffled (non-contiguous) KV pages with GQA."""

from __future__ import annotations

import math

import pytest
import torch

from ostinato.attention.base import AttentionMetadata
from ostinato.attention.torch_ref import TorchRefBackend, held_blocks

BLOCK_SIZE = 16
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 2, 32
SCALE = HEAD_DIM ** -0.5


class PagedCache:
    """A KV pool whose blocks are handed out in shuffled order; the last block is the scratch block."""

    def __init__(self, num_blocks: int, seed: int = 0, device: str = "cpu", dtype=torch.float32):
        gen = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.scratch = num_blocks
        shape = (num_blocks + 1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self.k_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.tables: list[list[int]] = []

    def add_sequence(self, length: int) -> int:
        self.tables.append([self.free.pop() for _ in range(math.ceil(length / BLOCK_SIZE))])
        return len(self.tables) - 1

    def slots(self, seq: int, start: int, end: int) -> list[int]:
        table = self.tables[seq]
        return [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]

    def block_tables(self, seqs: list[int], width: int) -> torch.Tensor:
        rows = [self.tables[s] + [self.scratch] * (width - len(self.tables[s])) for s in seqs]
        return torch.tensor(rows, dtype=torch.int32)


def dense_attention(q, keys, values, query_positions) -> torch.Tensor:
    """float64 reference. q [Q, H, D], keys/values [C, Hkv, D]; query i sees keys 0..query_positions[i]."""
    group = NUM_HEADS // NUM_KV_HEADS
    k = keys.double().repeat_interleave(group, dim=1)  # [C, H, D]
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * SCALE  # [H, Q, C]
    visible = torch.arange(keys.shape[0])[None, :] <= torch.tensor(query_positions)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def fill(cache: PagedCache, backend: TorchRefBackend, seq: int, keys, values, start: int = 0) -> None:
    slots = torch.tensor(cache.slots(seq, start, start + keys.shape[0]), dtype=torch.int64)
    backend.write_kv(keys, values, cache.k_cache, cache.v_cache, slots)


def test_write_kv_lands_in_the_mapped_slots():
    cache, backend = PagedCache(num_blocks=6), TorchRefBackend()
    seq = cache.add_sequence(20)
    keys, values = torch.randn(20, NUM_KV_HEADS, HEAD_DIM), torch.randn(20, NUM_KV_HEADS, HEAD_DIM)
    fill(cache, backend, seq, keys, values)
    for pos in (0, 15, 16, 19):
        block, offset = cache.tables[seq][pos // BLOCK_SIZE], pos % BLOCK_SIZE
        assert torch.equal(cache.k_cache[block, offset], keys[pos])
        assert torch.equal(cache.v_cache[block, offset], values[pos])
    assert cache.k_cache[cache.scratch].abs().sum() == 0


@pytest.mark.parametrize("num_padded_rows", [0, 3])
def test_decode_matches_dense_reference(num_padded_rows):
    torch.manual_seed(0)
    context_lens = [1, 15, 16, 17, 100]
    cache, backend = PagedCache(num_blocks=20, seed=1), TorchRefBackend()
    keys = [torch.randn(c, NUM_KV_HEADS, HEAD_DIM) for c in context_lens]
    values = [torch.randn(c, NUM_KV_HEADS, HEAD_DIM) for c in context_lens]
    seqs = [cache.add_sequence(c) for c in context_lens]
    # Everything but the last token was cached earlier; the decode step writes the last one.
    for s, c in zip(seqs, context_lens):
        fill(cache, backend, s, keys[s][:-1], values[s][:-1])
    assert any(b != a + 1 for t in cache.tables for a, b in zip(t, t[1:])), "blocks should be non-contiguous"

    width = 8  # wider than any table: unused entries point at the scratch block, as in a captured graph
    q = torch.randn(len(seqs) + num_padded_rows, NUM_HEADS, HEAD_DIM)
    real_slots = [cache.slots(s, c - 1, c)[0] for s, c in zip(seqs, context_lens)]
    # Padded rows write to and read from the scratch block only.
    slot_mapping = torch.tensor(real_slots + [cache.scratch * BLOCK_SIZE] * num_padded_rows)
    block_tables = torch.cat([cache.block_tables(seqs, width),
                              torch.full((num_padded_rows, width), cache.scratch, dtype=torch.int32)])
    garbage = 100 * torch.randn(num_padded_rows, NUM_KV_HEADS, HEAD_DIM)  # what padded rows write
    new_k = torch.cat([torch.stack([k[-1] for k in keys]), garbage])
    new_v = torch.cat([torch.stack([v[-1] for v in values]), garbage])
    meta = AttentionMetadata(
        is_prefill=False, slot_mapping=slot_mapping, block_tables=block_tables,
        context_lens=torch.tensor(context_lens + [1] * num_padded_rows, dtype=torch.int32))

    real_blocks_before = cache.k_cache[:cache.scratch].clone()
    backend.write_kv(new_k, new_v, cache.k_cache, cache.v_cache, meta.slot_mapping)
    out = backend.decode(q, cache.k_cache, cache.v_cache, meta, SCALE)

    assert out.shape == q.shape and torch.isfinite(out).all()
    for i, c in enumerate(context_lens):
        expected = dense_attention(q[i:i + 1], keys[i], values[i], [c - 1])
        torch.testing.assert_close(out[i:i + 1].double(), expected, atol=1e-5, rtol=1e-5)
    if num_padded_rows:
        # The padded writes touched only the scratch block (real blocks changed only at the real slots).
        changed = (cache.k_cache[:cache.scratch] != real_blocks_before).any(dim=(2, 3)).nonzero().tolist()
        assert sorted(b * BLOCK_SIZE + o for b, o in changed) == sorted(real_slots)


def test_decode_padded_row_with_zero_context_stays_finite():
    cache, backend = PagedCache(num_blocks=2), TorchRefBackend()
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.tensor([cache.scratch * BLOCK_SIZE]),
                             block_tables=torch.full((1, 2), cache.scratch, dtype=torch.int32),
                             context_lens=torch.zeros(1, dtype=torch.int32))
    out = backend.decode(torch.randn(1, NUM_HEADS, HEAD_DIM), cache.k_cache, cache.v_cache, meta, SCALE)
    assert torch.isfinite(out).all()


def test_cpu_decode_reads_only_the_blocks_a_sequence_holds():
    """A 20-token context in a 64-block window (max_model_len 1024) reads its 2 blocks: NaN in every block
    it does not hold (the scratch block its unused table entries name) would poison the output otherwise,
    as probability 0 times NaN is NaN."""
    torch.manual_seed(0)
    cache, backend = PagedCache(num_blocks=8, seed=4), TorchRefBackend()
    seq = cache.add_sequence(20)
    keys, values = torch.randn(20, NUM_KV_HEADS, HEAD_DIM), torch.randn(20, NUM_KV_HEADS, HEAD_DIM)
    cache.k_cache.fill_(float("nan"))
    cache.v_cache.fill_(float("nan"))
    fill(cache, backend, seq, keys, values)
    held = cache.tables[seq]
    for b in range(cache.scratch + 1):
        if b not in held:
            assert torch.isnan(cache.v_cache[b]).all()
    # The held blocks' tail past the context is NaN too; the mask must hide it (scores, not values, are
    # masked there, so zero its values: what a fresh block past the context holds is not this test's point).
    cache.v_cache[held[-1], 20 % BLOCK_SIZE:] = 0
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.tensor(cache.slots(seq, 19, 20)),
                             block_tables=cache.block_tables([seq], 64),
                             context_lens=torch.tensor([20], dtype=torch.int32))
    q = torch.randn(1, NUM_HEADS, HEAD_DIM)
    out = backend.decode(q, cache.k_cache, cache.v_cache, meta, SCALE)
    torch.testing.assert_close(out.double(), dense_attention(q, keys, values, [19]), atol=1e-5, rtol=1e-5)
    # The longest row sets the width: a 17-token and a 5-token row read 2 columns.
    tables = torch.zeros(2, 64, dtype=torch.int32)
    assert held_blocks(tables, torch.tensor([5, 17], dtype=torch.int32), BLOCK_SIZE).shape == (2, 2)


def test_prefill_over_cached_prefix_matches_dense_reference():
    torch.manual_seed(0)
    # (context_len after this step, new tokens): a fresh prompt, and one whose first 31 tokens are cached.
    seqs_spec = [(37, 37), (40, 9), (16, 1)]
    cache, backend = PagedCache(num_blocks=12, seed=2), TorchRefBackend()
    keys = [torch.randn(c, NUM_KV_HEADS, HEAD_DIM) for c, _ in seqs_spec]
    values = [torch.randn(c, NUM_KV_HEADS, HEAD_DIM) for c, _ in seqs_spec]
    seqs = [cache.add_sequence(c) for c, _ in seqs_spec]
    for s, (c, n) in zip(seqs, seqs_spec):  # the cached prefixes
        fill(cache, backend, s, keys[s][:c - n], values[s][:c - n])

    query_lens = [n for _, n in seqs_spec]
    q = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM)
    meta = AttentionMetadata(
        is_prefill=True,
        slot_mapping=torch.tensor([x for s, (c, n) in zip(seqs, seqs_spec) for x in cache.slots(s, c - n, c)]),
        block_tables=cache.block_tables(seqs, width=3),
        context_lens=torch.tensor([c for c, _ in seqs_spec], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 37, 46, 47], dtype=torch.int32),
        query_lens=query_lens, context_lens_host=[c for c, _ in seqs_spec], max_query_len=37, max_context_len=40)
    new_k = torch.cat([k[c - n:] for k, (c, n) in zip(keys, seqs_spec)])
    new_v = torch.cat([v[c - n:] for v, (c, n) in zip(values, seqs_spec)])
    backend.write_kv(new_k, new_v, cache.k_cache, cache.v_cache, meta.slot_mapping)
    out = backend.prefill(q, cache.k_cache, cache.v_cache, meta, SCALE)

    start = 0
    for s, (c, n) in enumerate(seqs_spec):
        expected = dense_attention(q[start:start + n], keys[s], values[s], list(range(c - n, c)))
        torch.testing.assert_close(out[start:start + n].double(), expected, atol=1e-5, rtol=1e-5)
        start += n

    # Without host lists the backend reads the same figures from the tensors.
    meta.query_lens = meta.context_lens_host = None
    torch.testing.assert_close(backend.prefill(q, cache.k_cache, cache.v_cache, meta, SCALE), out)


def test_decode_is_shape_static_and_sync_free():
    """On the meta device any .item(), data-dependent shape or branch on a value raises: a CPU proxy for
    "capturable in a CUDA graph"."""
    backend = TorchRefBackend()
    k_cache = torch.empty(9, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="meta")
    v_cache = torch.empty_like(k_cache)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.empty(4, dtype=torch.int64, device="meta"),
                             block_tables=torch.empty(4, 3, dtype=torch.int32, device="meta"),
                             context_lens=torch.empty(4, dtype=torch.int32, device="meta"))
    backend.write_kv(torch.empty(4, NUM_KV_HEADS, HEAD_DIM, device="meta"),
                     torch.empty(4, NUM_KV_HEADS, HEAD_DIM, device="meta"), k_cache, v_cache, meta.slot_mapping)
    out = backend.decode(torch.empty(4, NUM_HEADS, HEAD_DIM, device="meta"), k_cache, v_cache, meta, SCALE)
    assert out.shape == (4, NUM_HEADS, HEAD_DIM)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decode_replays_in_a_cuda_graph():
    torch.manual_seed(0)
    batch, width = 4, 8
    cache = PagedCache(num_blocks=40, seed=3, device="cuda", dtype=torch.bfloat16)
    backend = TorchRefBackend()
    cache.k_cache.normal_()
    cache.v_cache.normal_()
    static = dict(q=torch.zeros(batch, NUM_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
                  k=torch.zeros(batch, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
                  v=torch.zeros(batch, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16))
    meta = AttentionMetadata(is_prefill=False,
                             slot_mapping=torch.full((batch,), cache.scratch * BLOCK_SIZE, device="cuda"),
                             block_tables=torch.full((batch, width), cache.scratch, dtype=torch.int32, device="cuda"),
                             context_lens=torch.ones(batch, dtype=torch.int32, device="cuda"))

    def step():
        backend.write_kv(static["k"], static["v"], cache.k_cache, cache.v_cache, meta.slot_mapping)
        return backend.decode(static["q"], cache.k_cache, cache.v_cache, meta, SCALE)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step()

    # New inputs, copied into the static tensors, then replay vs eager on the same cache.
    lens = [5, 16, 33, 100]
    seqs = [cache.add_sequence(c) for c in lens]
    for name, t in static.items():
        t.copy_(torch.randn_like(t))
    meta.slot_mapping.copy_(torch.tensor([cache.slots(s, c - 1, c)[0] for s, c in zip(seqs, lens)]))
    meta.block_tables.copy_(cache.block_tables(seqs, width))
    meta.context_lens.copy_(torch.tensor(lens, dtype=torch.int32))
    graph.replay()
    torch.testing.assert_close(graph_out, step())
