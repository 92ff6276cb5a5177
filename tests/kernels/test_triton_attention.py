"""TritonPagedBackend against a dense float64 reference (and TorchRefBackend when it exists).

On a CPU machine the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set before triton is
imported), so sizes stay small; every dtype at long contexts and the CUDA-graph test run on the GPU
(`PYTHONPATH=src python3 -m pytest -m gpu tests/kernels/test_triton_attention.py`).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # tests/conftest.py does the same; kept so this file runs alone

pytest.importorskip("triton")

from ostinato.kernels import attention_common as triton_common  # noqa: E402
from ostinato.attention.base import AttentionMetadata  # noqa: E402
from ostinato.kernels.decode_attention import DecodeTuning, choose_num_splits  # noqa: E402
from ostinato.attention.triton_paged import TritonAttentionTuning, TritonPagedBackend  # noqa: E402
from ostinato.errors import ConfigError  # noqa: E402
from support.cuda_profile import count_cuda_kernels  # noqa: E402

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(
        not triton_common.KERNELS_INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda]),
]
# Loose tolerances for 16-bit: probabilities are rounded to the value dtype before the P @ V dot.
TOLERANCES = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


class PagedCache:
    """A KV pool whose sequences sit in shuffled, non-contiguous blocks; the last block is scratch.

    Every slot that holds no token is `filler` (NaN by default), so a kernel that reads past a context
    (or into another sequence's or an unused block) poisons its output and the comparison fails.
    """

    def __init__(self, context_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, device: str, seed: int = 0, spare_blocks: int = 3, extra_width: int = 2,
                 filler: float = float("nan")):
        gen = torch.Generator().manual_seed(seed)
        blocks_needed = [math.ceil(c / block_size) for c in context_lens]
        num_blocks = sum(blocks_needed) + spare_blocks
        self.scratch_block = num_blocks
        self.block_size = block_size
        shape = (num_blocks + 1, block_size, num_kv_heads, head_dim)  # [blocks + scratch, block, Hkv, D]
        self.k_cache = torch.full(shape, filler, dtype=dtype)
        self.v_cache = torch.full(shape, filler, dtype=dtype)
        width = max(blocks_needed + [1]) + extra_width
        self.block_tables = torch.full((len(context_lens), width), self.scratch_block, dtype=torch.int32)
        perm = torch.randperm(num_blocks, generator=gen)
        used = 0
        for s, (ctx, n) in enumerate(zip(context_lens, blocks_needed)):
            self.block_tables[s, :n] = perm[used:used + n].to(torch.int32)
            used += n
            blocks, offsets = self.positions(s, ctx)
            self.k_cache[blocks, offsets] = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
            self.v_cache[blocks, offsets] = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        self.context_lens = torch.tensor(context_lens, dtype=torch.int32)
        self.to(device)

    def to(self, device: str) -> None:
        for name in ("k_cache", "v_cache", "block_tables", "context_lens"):
            setattr(self, name, getattr(self, name).to(device))

    def positions(self, seq: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
        toks = torch.arange(ctx)
        return self.block_tables[seq, toks // self.block_size].long().cpu(), toks % self.block_size

    def dense_kv(self, seq: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks, offsets = self.positions(seq, ctx)
        k, v = self.k_cache.cpu(), self.v_cache.cpu()
        return k[blocks, offsets].double(), v[blocks, offsets].double()  # [ctx, Hkv, D]


def reference_attention(q: torch.Tensor, cache: PagedCache, query_lens: list[int], scale: float) -> torch.Tensor:
    """Causal float64 attention; query i of a sequence with context C and Q new tokens is at C - Q + i."""
    q = q.cpu().double()  # [num_tokens, H, D]
    host = PagedCache.__new__(PagedCache)  # the pool copied to the host once, not once per sequence
    host.__dict__.update(cache.__dict__)
    host.to("cpu")
    cache = host
    outs, start = [], 0
    for s, q_len in enumerate(query_lens):
        ctx = int(cache.context_lens[s])
        k, v = cache.dense_kv(s, ctx)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [ctx, H, D]
        scores = torch.einsum("qhd,khd->hqk", q[start:start + q_len], k) * scale
        q_pos = torch.arange(ctx - q_len, ctx)[:, None]
        scores = scores.masked_fill(torch.arange(ctx)[None, :] > q_pos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        start += q_len
    return torch.cat(outs)


def decode_meta(cache: PagedCache) -> AttentionMetadata:
    num_seqs = cache.block_tables.shape[0]
    slots = torch.zeros(num_seqs, dtype=torch.int64, device=cache.block_tables.device)
    return AttentionMetadata(is_prefill=False, slot_mapping=slots, block_tables=cache.block_tables,
                             context_lens=cache.context_lens)


def prefill_meta(cache: PagedCache, query_lens: list[int]) -> AttentionMetadata:
    device = cache.block_tables.device
    starts = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return AttentionMetadata(
        is_prefill=True, slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64, device=device),
        block_tables=cache.block_tables, context_lens=cache.context_lens,
        query_start_loc=starts.to(device), query_lens=list(query_lens),
        context_lens_host=cache.context_lens.tolist(), max_query_len=max(query_lens),
        max_context_len=int(cache.context_lens.max()))


def backend_with(**decode_tuning) -> TritonPagedBackend:
    return TritonPagedBackend(TritonAttentionTuning(decode=DecodeTuning(**decode_tuning)))


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCES[dtype]
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu().double(), ref, atol=tol, rtol=tol)


# ---- write_kv ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_places_exactly_the_mapped_slots(device, dtype):
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 6, 4, 3, 32, 9
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[4] = -1  # a padded token: must write nowhere
    # k and v as strided views of one fused projection output, as a model produces them.
    fused = torch.randn(num_tokens, 2, num_kv_heads, head_dim, generator=gen).to(dtype)
    k, v = fused[:, 0], fused[:, 1]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)

    TritonPagedBackend().write_kv(k.to(device), v.to(device), k_cache, v_cache, slots.to(device))

    flat_k = k_cache.cpu().reshape(-1, num_kv_heads, head_dim)  # [slots, Hkv, D]
    flat_v = v_cache.cpu().reshape(-1, num_kv_heads, head_dim)
    real = slots >= 0
    assert torch.equal(flat_k[slots[real]], k[real]) and torch.equal(flat_v[slots[real]], v[real])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots[real]] = False
    assert torch.isnan(flat_k[untouched]).all() and torch.isnan(flat_v[untouched]).all()


# ---- decode -----------------------------------------------------------------------------------------------

def run_decode(device, dtype, context_lens, group, num_kv_heads=2, head_dim=64, block_size=16,
               backend=None, seed=0):
    cache = PagedCache(context_lens, num_kv_heads, head_dim, block_size, dtype, device, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    q = torch.randn(len(context_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    out = (backend or TritonPagedBackend()).decode(q.to(device), cache.k_cache, cache.v_cache,
                                                   decode_meta(cache), scale)
    assert out.shape == q.shape
    return out, reference_attention(q, cache, [1] * len(context_lens), scale)


# 1 split: the split kernel writes the output (no merge); 5 (not a power of two): slices of 16 tokens
# merged by the last-arriving slice, with contexts that fill fewer slices than splits (1, 15, 16, 17) and all.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("splits", [1, 5])
def test_decode_matches_reference(device, dtype, group, splits):
    out, ref = run_decode(device, dtype, [1, 15, 16, 17, 100, 200], group,
                          backend=backend_with(splits=splits, block_n=16))
    assert_close_to_reference(out, ref, dtype)


# The single-launch merge at several split counts, GQA ratios and head dims, contexts crossing block and
# slice boundaries. group 8 at head_dim 128 merges in chunks of 8 slices (20 splits: 2 chunks of 13 active).
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim,group,splits", [(64, 1, 2), (64, 2, 7), (128, 4, 3), (128, 8, 20), (64, 3, 16)])
def test_single_launch_decode_matches_reference(device, head_dim, group, splits):
    backend = backend_with(splits=splits, block_n=16)
    out, ref = run_decode(device, torch.float32, [1, 16, 17, 33, 400], group, num_kv_heads=2, head_dim=head_dim,
                          backend=backend)
    assert_close_to_reference(out, ref, torch.float32)
    counters = backend.split_counters.get(out.device, 0)
    assert not counters.any()  # every (sequence, kv head) counter reset by its merging program


# A merge chunk of one slice (merge_chunk_elems = group x head_dim): the merge loops once per active slice.
@pytest.mark.parametrize("device", DEVICES)
def test_single_launch_merge_one_slice_a_chunk(device):
    backend = backend_with(splits=9, block_n=16, merge_chunk_elems=4 * 64)
    out, ref = run_decode(device, torch.float32, [1, 50, 144], 4, num_kv_heads=2, head_dim=64, backend=backend)
    assert_close_to_reference(out, ref, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_single_launch_decode_twice_with_new_data(device):
    """The counters must be back at 0 after a launch: a second launch (other data, other lengths, the same
    backend and shapes, as a graph replay) merges correctly too."""
    backend = backend_with(splits=6, block_n=16)
    for seed, lens in ((0, [40, 7, 90]), (1, [90, 33, 1])):
        out, ref = run_decode(device, torch.float32, lens, 2, backend=backend, seed=seed)
        assert_close_to_reference(out, ref, torch.float32)


# Contexts of thousands of tokens, slices of many tiles each. The interpreter takes seconds for these, so
# the CPU runs one case; the GPU runs every dtype and group.
@pytest.mark.parametrize("device,dtype,group", [pytest.param("cpu", torch.float32, 4, marks=DEVICES[0].marks)] + [
    pytest.param("cuda", dtype, group, marks=DEVICES[1].marks) for dtype in DTYPES for group in (1, 4)])
def test_decode_long_contexts(device, dtype, group):
    num_kv_heads, head_dim = (4, 128) if device == "cuda" else (1, 64)
    context_lens = [1000, 8191] if device == "cpu" else [1, 1000, 8191, 17, 4096]
    backend = backend_with(splits=4) if device == "cpu" else None  # the GPU: the split count it chooses
    out, ref = run_decode(device, dtype, context_lens, group, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          backend=backend)
    assert_close_to_reference(out, ref, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim,block_size,group", [(128, 16, 8), (16, 32, 2), (40, 8, 3)])
def test_decode_other_shapes(device, head_dim, block_size, group):
    # head_dim 40 and group 3 are not powers of two: the kernels pad and mask them.
    out, ref = run_decode(device, torch.float32, [3, 33, 70], group, num_kv_heads=1, head_dim=head_dim,
                          block_size=block_size, backend=backend_with(splits=3, block_n=16))
    assert_close_to_reference(out, ref, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_zero_context_row_gives_zeros_not_nan(device, splits):
    cache = PagedCache([0, 20], num_kv_heads=1, head_dim=16, block_size=16, dtype=torch.float32, device=device)
    q = torch.randn(2, 2, 16)
    out = backend_with(splits=splits, block_n=16).decode(
        q.to(device), cache.k_cache, cache.v_cache, decode_meta(cache), 0.25)
    assert torch.equal(out[0].cpu(), torch.zeros(2, 16))
    ref = reference_attention(q[1:], _only_seq(cache, 1), [1], 0.25)
    torch.testing.assert_close(out[1:].cpu().double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_in_a_compile_ahead_pass_hands_its_launch_over_and_writes_zeros(device, splits):
    """kernels/deferred_launch.py: the split kernel is handed over, not run, and its output is zeros (an
    unwritten output would be whatever the allocator held)."""
    from ostinato.kernels import decode_attention
    from ostinato.kernels.deferred_launch import compiling_instead

    handed = []
    with compiling_instead(lambda kernel, grid, args, kwargs: handed.append((kernel, grid, kwargs["SPLIT"]))):
        out, ref = run_decode(device, torch.float32, [1, 17, 40], 2, backend=backend_with(splits=splits, block_n=16))
    assert handed == [(decode_attention._decode_split_kernel, (3, 2, splits), splits > 1)]
    assert not out.any() and ref.abs().sum() > 0


def _only_seq(cache: PagedCache, seq: int) -> PagedCache:
    view = PagedCache.__new__(PagedCache)
    view.__dict__.update(cache.__dict__)
    view.block_tables, view.context_lens = cache.block_tables[seq:seq + 1], cache.context_lens[seq:seq + 1]
    return view


def test_split_count_fills_the_gpu_from_shapes_only():
    tuning = DecodeTuning(block_n=32, programs_per_sm=2, max_splits=64)
    # Batch 1, 8 kv heads, 132 SMs: 264 programs wanted, 8 per split -> 33 splits.
    assert choose_num_splits(tuning, num_seqs=1, num_kv_heads=8, max_context=2048, num_sms=132) == 33
    # Batch 16: 264 // 128 -> 2, rounded down so that every program is resident at once (3 would be 384).
    assert choose_num_splits(tuning, num_seqs=16, num_kv_heads=8, max_context=2048, num_sms=132) == 2
    assert choose_num_splits(DecodeTuning(), num_seqs=16, num_kv_heads=8, max_context=2048, num_sms=132) == 4
    # A batch whose programs cover every SM: one split, so no merge.
    assert choose_num_splits(tuning, num_seqs=17, num_kv_heads=8, max_context=2048, num_sms=132) == 1
    assert choose_num_splits(tuning, num_seqs=64, num_kv_heads=8, max_context=2048, num_sms=132) == 1
    # Never more slices than tiles in the widest context, nor than max_splits.
    assert choose_num_splits(tuning, num_seqs=1, num_kv_heads=1, max_context=64, num_sms=132) == 2
    assert choose_num_splits(tuning, num_seqs=1, num_kv_heads=1, max_context=1 << 20, num_sms=132) == 64
    assert choose_num_splits(DecodeTuning(splits=7), 64, 8, 2048, 132) == 7
    # A full GPU still splits a table wider than max_keys_per_program (one long sequence must not straggle).
    assert choose_num_splits(tuning, num_seqs=64, num_kv_heads=8, max_context=8448, num_sms=132) == 5
    assert choose_num_splits(tuning, num_seqs=64, num_kv_heads=8, max_context=32768, num_sms=132) == 16
    assert choose_num_splits(tuning, num_seqs=16, num_kv_heads=8, max_context=32768, num_sms=132) == 16


def test_split_launches_take_their_own_warps_and_pipeline_depth():
    tuning = DecodeTuning(num_warps=2, num_stages=3, split_num_warps=4, split_num_stages=1)
    # batch 1 x 8 kv heads on 132 SMs: splitting fills the GPU, the split settings
    assert [tuning.launch_for(splits, 8, 132) for splits in (1, 2, 64)] == [(2, 3), (4, 1), (4, 1)]
    # 64 x 8 programs fill it already: a split for a wide table (max_keys_per_program) keeps the unsplit ones
    assert [tuning.launch_for(splits, 512, 132) for splits in (1, 2, 16)] == [(2, 3), (2, 3), (2, 3)]


# merge_tile_for_max_splits: the merge tile sized for max_splits (32 here, so every split count below pads past
# its own power of two), lanes past the split count masked; a merge chunk of 8 slices makes the 20-way split loop.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim,group,splits,chunk_elems", [(64, 1, 2, 8192), (64, 2, 7, 8192),
                                                               (128, 4, 20, 4 * 128 * 8)])
def test_a_merge_tile_sized_for_max_splits_gives_the_reference(device, head_dim, group, splits, chunk_elems):
    backend = backend_with(splits=splits, block_n=16, max_splits=32, merge_tile_for_max_splits=True,
                           merge_chunk_elems=chunk_elems)
    out, ref = run_decode(device, torch.float32, [1, 16, 17, 33, 400], group, num_kv_heads=2, head_dim=head_dim,
                          backend=backend)
    assert_close_to_reference(out, ref, torch.float32)
    assert not backend.split_counters.get(out.device, 0).any()


def split_launch_keys(tuning: DecodeTuning, batches, num_kv_heads: int, group: int, head_dim: int, max_context: int):
    """What Triton keys a compile of the decode kernel by (its constexprs and launch options, and the ==1 / %16
    specialisation of its int arguments) for each split launch a capture at these batch sizes makes, on a
    132-SM GPU: the launches handed to a compile-ahead pass (kernels/deferred_launch.py), not run."""
    from unittest import mock

    from ostinato.kernels import decode_attention
    from ostinato.kernels.deferred_launch import compiling_instead
    from ostinato.kernels.split_counters import SplitCounters

    keys = set()

    def sink(kernel, grid, args, kwargs):
        if kwargs["SPLIT"]:
            ints = tuple((a == 1, a % 16 == 0) for a in args if isinstance(a, int) and not isinstance(a, bool))
            keys.add((tuple(sorted(kwargs.items())), ints))

    block_size = 16
    k_cache = torch.zeros(4, block_size, num_kv_heads, head_dim)
    with mock.patch.object(decode_attention, "num_sms", lambda device: 132), compiling_instead(sink):
        for b in batches:
            q = torch.zeros(b, num_kv_heads * group, head_dim)
            tables = torch.zeros(b, max_context // block_size, dtype=torch.int32)
            decode_attention.paged_decode(q, k_cache, k_cache, tables, torch.ones(b, dtype=torch.int32), 0.125,
                                          group, tuning, SplitCounters())
    return keys


def test_a_merge_tile_sized_for_max_splits_compiles_one_kernel_where_each_split_count_compiled_its_own():
    """The batch sizes a capture plans up to 64, with llama-3.1-8b's heads and an 8,192-token table: batches 1,
    2, 4, 8 and 16 split 64, 33, 16, 8 and 4 ways to fill the GPU, and the larger ones 4 ways with the unsplit
    warps and stages (no program scans over max_keys_per_program keys): six compiles, as many as a cold start
    of the 8B compiled on the H200 with each merge tile sized for its own split count. With the merge tile
    sized for max_splits (the default), the first five share one but for the int argument num_splits (a
    multiple of 16 or not): three."""
    batches = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    shape = dict(num_kv_heads=8, group=4, head_dim=128, max_context=8192)
    assert len(split_launch_keys(DecodeTuning(merge_tile_for_max_splits=False), batches, **shape)) == 6
    assert len(split_launch_keys(DecodeTuning(), batches, **shape)) == 3


@pytest.mark.parametrize("device", DEVICES)
def test_decode_with_the_chosen_split_count_at_batch_one(device):
    # Batch 1 is where splitting matters; the CPU pretends to have 4 SMs, so this splits 8 ways.
    out, ref = run_decode(device, torch.float32, [130], 2, num_kv_heads=1, head_dim=32,
                          backend=backend_with(block_n=16))
    assert_close_to_reference(out, ref, torch.float32)


# ---- decode_with_rope: q/k norm, RoPE and the K/V write inside the decode kernel ----------------------------

class RopeCase:
    """decode_with_rope's inputs: sequence s's new token at position context_len - 1, its slot taken from
    the table; the last `pad_rows` rows are padded ones as the runner pads a graph (context 1, every table
    entry the scratch block, so their new K/V all go to the scratch block's first slot). refresh() derives
    positions and slots from the cache's current tables and lengths (in place: a graph may hold them)."""

    def __init__(self, device, dtype, context_lens, group, num_kv_heads, head_dim, qk_norm, seed=0, filler=1e4,
                 pad_rows=1):
        from ostinato.model.layers import RotaryEmbedding

        lens = list(context_lens) + [1] * pad_rows
        self.num_real = len(context_lens)
        self.cache = PagedCache(lens, num_kv_heads, head_dim, 16, dtype, device, seed=seed, filler=filler,
                                spare_blocks=3 + len(lens))
        self.pad_tables()
        self.num_heads, self.num_kv_heads = num_kv_heads * group, num_kv_heads
        gen = torch.Generator().manual_seed(seed + 50)
        self.heads = torch.randn(len(lens), self.num_heads + 2 * num_kv_heads, head_dim,
                                 generator=gen).to(device, dtype)
        with torch.device(device):
            self.rope = RotaryEmbedding(head_dim, 16384, 10000.0, None)
        self.rope.rebuild(torch.device(device), dtype)
        self.weights = tuple((1 + 0.3 * torch.randn(head_dim, generator=gen)).to(device, dtype) for _ in range(2)) \
            if qk_norm else (None, None)
        self.positions = torch.zeros(len(lens), dtype=torch.int64, device=device)
        self.meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros_like(self.positions),
                                      block_tables=self.cache.block_tables, context_lens=self.cache.context_lens)
        self.scale = head_dim ** -0.5
        self.refresh()

    def pad_tables(self) -> None:
        """The padded rows read and write the scratch block only."""
        self.cache.block_tables[self.num_real:] = self.cache.scratch_block

    def refresh(self) -> None:
        rows = torch.arange(len(self.positions), device=self.positions.device)
        self.positions.copy_(self.cache.context_lens.long() - 1)
        blocks = self.cache.block_tables[rows, self.positions // 16].long()
        self.meta.slot_mapping.copy_(blocks * 16 + self.positions % 16)

    def run(self, backend) -> torch.Tensor:
        return backend.decode_with_rope(self.heads, *self.weights, self.rope.cos_sin_cache, self.positions, 1e-6,
                                        self.cache.k_cache, self.cache.v_cache, self.meta, self.scale)

    def expected(self, caches_before) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The unfused steps on the caches as they were before the run: torch q/k norm + RoPE, a plain
        write, float64 attention. (reference out, (k_cache, v_cache) after the write)."""
        from ostinato.kernels import fused

        h, kv = self.num_heads, self.num_kv_heads
        qk = fused.qk_norm_rope_ref(self.heads, *self.weights, self.rope.cos_sin_cache, self.positions, h, kv, 1e-6)
        k_cache, v_cache = (c.clone() for c in caches_before)
        slots = self.meta.slot_mapping
        k_cache.flatten(0, 1)[slots] = qk[:, h:]
        v_cache.flatten(0, 1)[slots] = self.heads[:, h + kv:]
        written = PagedCache.__new__(PagedCache)
        written.__dict__.update(self.cache.__dict__)
        written.k_cache, written.v_cache = k_cache, v_cache
        return reference_attention(qk[:, :h], written, [1] * len(slots), self.scale), (k_cache, v_cache)


def run_decode_with_rope(device, dtype, context_lens, group, num_kv_heads, head_dim, qk_norm, backend, seed=0):
    """(out, reference out, caches after, expected caches after) of one decode_with_rope call."""
    case = RopeCase(device, dtype, context_lens, group, num_kv_heads, head_dim, qk_norm, seed)
    ref, expected = case.expected((case.cache.k_cache, case.cache.v_cache))
    out = case.run(backend)
    return out, ref, (case.cache.k_cache, case.cache.v_cache), expected


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk-norm", "rope-only"])
@pytest.mark.parametrize("splits", [1, 5])
def test_decode_with_rope_matches_the_unfused_steps(device, dtype, qk_norm, splits):
    """Contexts whose newest token opens a block (17, 33), ends one (16), is the only one (1), and longer."""
    backend = backend_with(splits=splits, block_n=16)
    out, ref, caches, expected = run_decode_with_rope(device, dtype, [1, 16, 17, 33, 90], 2, 2, 32, qk_norm,
                                                      backend)
    assert out.shape == ref.shape
    assert_close_to_reference(out, ref, dtype)
    for actual, want in zip(caches, expected):
        if dtype == torch.float32:
            torch.testing.assert_close(actual.cpu(), want.cpu(), atol=1e-6, rtol=1e-6)
        else:  # the kernel's RMSNorm sums in another order than torch's: rare 1-ulp flips
            torch.testing.assert_close(actual.cpu().float(), want.cpu().float(), atol=1e-2, rtol=1e-2)
            assert (actual == want).float().mean() > 0.999


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim,group", [(64, 1), (128, 4), (48, 3)])
def test_decode_with_rope_other_shapes(device, head_dim, group):
    out, ref, caches, expected = run_decode_with_rope(device, torch.float32, [5, 40], group, 2, head_dim, True,
                                                      backend_with(splits=3, block_n=16))
    assert_close_to_reference(out, ref, torch.float32)
    torch.testing.assert_close(caches[0].cpu(), expected[0].cpu(), atol=1e-6, rtol=1e-6)


# ---- prefill ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("cached_prefix", [False, True], ids=["fresh", "cached-prefix"])
def test_prefill_matches_reference(device, dtype, group, cached_prefix):
    query_lens = [1, 7, 70, 33]
    prefixes = [5, 16, 0, 31] if cached_prefix else [0, 0, 0, 0]
    context_lens = [p + q for p, q in zip(prefixes, query_lens)]
    num_kv_heads, head_dim = 2, 32
    cache = PagedCache(context_lens, num_kv_heads, head_dim, 16, dtype, device, seed=3)
    q = torch.randn(sum(query_lens), num_kv_heads * group, head_dim,
                    generator=torch.Generator().manual_seed(4)).to(dtype)
    out = TritonPagedBackend().prefill(q.to(device), cache.k_cache, cache.v_cache,
                                       prefill_meta(cache, query_lens), 0.2)
    assert out.shape == q.shape
    assert_close_to_reference(out, reference_attention(q, cache, query_lens, 0.2), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_last_token_agrees_with_decode(device):
    # The same query at the end of the same context must give the same answer on both paths.
    query_lens, head_dim = [9, 40], 64
    cache = PagedCache([20, 40], 2, head_dim, 16, torch.float32, device, seed=5)
    q = torch.randn(sum(query_lens), 4, head_dim, generator=torch.Generator().manual_seed(6)).to(device)
    backend = backend_with(splits=4, block_n=16)
    prefill_out = backend.prefill(q, cache.k_cache, cache.v_cache, prefill_meta(cache, query_lens), 0.125)
    last = torch.tensor([8, 48], device=device)
    decode_out = backend.decode(q[last], cache.k_cache, cache.v_cache, decode_meta(cache), 0.125)
    torch.testing.assert_close(decode_out, prefill_out[last], atol=1e-5, rtol=1e-5)


# ---- against the torch reference backend, once it exists ---------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_matches_torch_reference_backend(device):
    torch_ref = pytest.importorskip("ostinato.attention.torch_ref")
    reference, triton_backend = torch_ref.TorchRefBackend(), backend_with(splits=3, block_n=16)
    query_lens = [4, 30, 1]
    # TorchRefBackend.decode multiplies zero probabilities by every slot of the table, so unused slots
    # must be finite for it (0 * NaN = NaN); a large filler still exposes a kernel reading past a context.
    cache = PagedCache([10, 30, 77], 2, 32, 16, torch.float32, device, seed=7, filler=1e4)
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(sum(query_lens), 8, 32, generator=gen).to(device)
    meta = prefill_meta(cache, query_lens)
    torch.testing.assert_close(triton_backend.prefill(q, cache.k_cache, cache.v_cache, meta, 0.3),
                               reference.prefill(q, cache.k_cache, cache.v_cache, meta, 0.3),
                               atol=2e-5, rtol=2e-5)
    q1 = torch.randn(3, 8, 32, generator=gen).to(device)
    meta = decode_meta(cache)
    torch.testing.assert_close(triton_backend.decode(q1, cache.k_cache, cache.v_cache, meta, 0.3),
                               reference.decode(q1, cache.k_cache, cache.v_cache, meta, 0.3),
                               atol=2e-5, rtol=2e-5)


# ---- errors and CUDA graphs ---------------------------------------------------------------------------------

def test_cpu_tensors_without_interpreter_raise_a_config_error(monkeypatch):
    monkeypatch.setattr(triton_common, "KERNELS_INTERPRETED", False)
    k = torch.zeros(1, 1, 16)
    cache = torch.zeros(2, 16, 1, 16)
    with pytest.raises(ConfigError, match="--attention-backend torch"):
        TritonPagedBackend().write_kv(k, k, cache, cache, torch.zeros(1, dtype=torch.int64))


def test_bad_tuning_arguments_raise_a_config_error():
    with pytest.raises(ConfigError, match="block_n must be a power of two"):
        DecodeTuning(block_n=100)
    with pytest.raises(ConfigError, match="num_warps"):
        DecodeTuning(num_warps=0)
    with pytest.raises(ConfigError, match="splits"):
        DecodeTuning(splits=0)
    with pytest.raises(ConfigError, match="merge_chunk_elems"):
        DecodeTuning(merge_chunk_elems=0)
    with pytest.raises(ConfigError, match="split_num_stages"):
        DecodeTuning(split_num_stages=0)
    with pytest.raises(ConfigError, match="late_trigger_programs"):
        DecodeTuning(late_trigger_programs=-1)
    with pytest.raises(ConfigError, match="prefill_block_n must be a power of two"):
        TritonAttentionTuning(prefill_block_n=48)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("splits", [1, 16, None])
def test_decode_replays_in_a_cuda_graph_with_new_tables(splits):
    dtype, num_kv_heads, head_dim, block_size, group = torch.bfloat16, 2, 128, 16, 4
    backend = backend_with(splits=splits)
    first = PagedCache([5, 300, 1000, 64], num_kv_heads, head_dim, block_size, dtype, "cuda", seed=10,
                       spare_blocks=40, extra_width=10)
    # Static inputs at their captured shapes; every step copies into them.
    static_q = torch.randn(4, num_kv_heads * group, head_dim, device="cuda", dtype=dtype)
    static_tables = first.block_tables.clone()
    static_lens = first.context_lens.clone()
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(4, dtype=torch.int64, device="cuda"),
                             block_tables=static_tables, context_lens=static_lens)
    k_cache, v_cache = first.k_cache, first.v_cache

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.decode(static_q, k_cache, v_cache, meta, 0.1)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = backend.decode(static_q, k_cache, v_cache, meta, 0.1)

    # New step: other lengths and a different shuffle of the same pool, written in place.
    new_lens = [900, 1, 17, 200]
    gen = torch.Generator().manual_seed(11)
    perm = torch.randperm(first.scratch_block, generator=gen)
    new_tables = torch.full_like(static_tables.cpu(), first.scratch_block)
    used = 0
    for s, ctx in enumerate(new_lens):
        n = math.ceil(ctx / block_size)
        new_tables[s, :n] = perm[used:used + n].to(torch.int32)
        used += n
    k_cache.copy_(torch.randn(k_cache.shape, generator=gen).to(dtype))
    v_cache.copy_(torch.randn(v_cache.shape, generator=gen).to(dtype))
    static_tables.copy_(new_tables)
    static_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
    static_q.copy_(torch.randn(static_q.shape, generator=gen).to(dtype))
    graph.replay()
    torch.cuda.synchronize()

    view = PagedCache.__new__(PagedCache)
    view.__dict__.update(first.__dict__)
    view.block_tables, view.context_lens = static_tables, static_lens
    assert_close_to_reference(static_out, reference_attention(static_q, view, [1] * 4, 0.1), dtype)
    eager = backend.decode(static_q, k_cache, v_cache, meta, 0.1)
    assert torch.equal(static_out, eager)


# ---- the single-launch decode at real shapes, in CUDA graphs (GPU) -------------------------------------------

def real_gpu_shapes(test):
    """On the GPU at the real shapes: head_dim 128, 8 kv heads, 16 or 32 q heads, batch 1/4/16, context 512
    and 8192 (the test body sets head_dim and kv heads)."""
    marks = (pytest.mark.parametrize("context", [512, 8192]), pytest.mark.parametrize("batch", [1, 4, 16]),
             pytest.mark.parametrize("num_heads", [16, 32]), requires_cuda, pytest.mark.gpu)
    for mark in marks:
        test = mark(test)
    return test


def _reshuffle(cache: PagedCache, new_lens: list[int], gen: torch.Generator) -> None:
    """Another step over the same pool (same tensors, as a captured graph needs): new lengths, a new
    shuffle of the blocks and new K/V contents, written in place."""
    perm = torch.randperm(cache.scratch_block, generator=gen)
    tables = torch.full(cache.block_tables.shape, cache.scratch_block, dtype=torch.int32)
    used = 0
    for s, ctx in enumerate(new_lens):
        n = math.ceil(ctx / cache.block_size)
        tables[s, :n] = perm[used:used + n].to(torch.int32)
        used += n
    assert used <= cache.scratch_block
    device_gen = torch.Generator(device=cache.k_cache.device).manual_seed(int(perm[0]))  # fast for a large pool
    for pool in (cache.k_cache, cache.v_cache):
        pool.copy_(torch.randn(pool.shape, generator=device_gen, device=pool.device).to(pool.dtype))
    cache.block_tables.copy_(tables)
    cache.context_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))


@real_gpu_shapes
def test_single_launch_decode_real_shapes_replays_in_a_cuda_graph(num_heads, batch, context):
    """head_dim 128, 8 kv heads, bf16, the split count the backend chooses (> 1 here: the merge runs in the
    last-arriving program): eager, then one captured graph replayed twice on new lengths, tables, K/V and
    q, each against the float64 reference and eager; the counters end at zero; one kernel per call."""
    from ostinato.kernels.device import num_sms

    dtype, num_kv_heads, head_dim, block_size = torch.bfloat16, 8, 128, 16
    backend = TritonPagedBackend()
    lens = [max(1, context - 37 * i) for i in range(batch)]
    cache = PagedCache(lens, num_kv_heads, head_dim, block_size, dtype, "cuda", seed=20)
    width = cache.block_tables.shape[1] * block_size
    splits = choose_num_splits(backend.tuning.decode, batch, num_kv_heads, width, num_sms(torch.device("cuda")))
    assert splits > 1, splits  # a split launch: its last-arriving slice merges
    gen = torch.Generator().manual_seed(21)
    static_q = torch.randn(batch, num_heads, head_dim, generator=gen).to("cuda", dtype)
    meta = decode_meta(cache)
    scale = head_dim ** -0.5

    eager = backend.decode(static_q, cache.k_cache, cache.v_cache, meta, scale)  # compiles outside the capture
    assert_close_to_reference(eager, reference_attention(static_q, cache, [1] * batch, scale), dtype)
    names = count_cuda_kernels(lambda: backend.decode(static_q, cache.k_cache, cache.v_cache, meta, scale))
    assert names == [n for n in names if "_decode_split_kernel" in n] and len(names) == 1, names

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = backend.decode(static_q, cache.k_cache, cache.v_cache, meta, scale)
    for step in range(2):
        _reshuffle(cache, lens[step + 1:] + lens[:step + 1], gen)  # the same blocks in all, other lengths
        static_q.copy_(torch.randn(static_q.shape, generator=gen).to(dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert_close_to_reference(static_out, reference_attention(static_q, cache, [1] * batch, scale), dtype)
        assert torch.equal(static_out, backend.decode(static_q, cache.k_cache, cache.v_cache, meta, scale))
        assert not backend.split_counters.get(static_q.device, 0).any()


@real_gpu_shapes
def test_decode_with_rope_real_shapes_replays_in_a_cuda_graph(num_heads, batch, context):
    """head_dim 128, 8 kv heads, bf16, Qwen3's q/k norm, the backend's own split choice: eager against the
    unfused steps (reference attention and cache contents), then a graph replayed twice on new lengths,
    tables, K/V, qkv and positions, each against the unfused steps and eager; counters back at zero."""
    backend = TritonPagedBackend()
    lens = [max(1, context - 37 * i) for i in range(batch)]
    case = RopeCase("cuda", torch.bfloat16, lens, num_heads // 8, 8, 128, True, seed=40, filler=0.0)
    ref, expected = case.expected((case.cache.k_cache, case.cache.v_cache))
    out = case.run(backend)  # eager; compiles outside the capture
    assert_close_to_reference(out, ref, torch.bfloat16)
    for actual, want in zip((case.cache.k_cache, case.cache.v_cache), expected):
        torch.testing.assert_close(actual.float(), want.float(), atol=1e-2, rtol=1e-2)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = case.run(backend)
    gen = torch.Generator().manual_seed(41)
    all_lens = lens + [1]
    for step in range(2):
        new_lens = all_lens[:-1][step + 1:] + all_lens[:-1][:step + 1] + [1]
        _reshuffle(case.cache, new_lens, gen)
        case.pad_tables()
        case.refresh()
        case.heads.copy_(torch.randn(case.heads.shape, generator=gen).to(torch.bfloat16))
        before = (case.cache.k_cache.clone(), case.cache.v_cache.clone())
        ref, expected = case.expected(before)
        graph.replay()
        torch.cuda.synchronize()
        assert_close_to_reference(static_out, ref, torch.bfloat16)
        for actual, want in zip((case.cache.k_cache, case.cache.v_cache), expected):
            torch.testing.assert_close(actual.float(), want.float(), atol=1e-2, rtol=1e-2)
        assert torch.equal(static_out, case.run(backend))  # eager on the same inputs (rewrites the same K/V)
        assert not backend.split_counters.get(static_out.device, 0).any()
