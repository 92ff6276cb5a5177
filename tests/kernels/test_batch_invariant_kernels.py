"""The batch-invariant kernels (--batch-invariant), bit for bit: a row's result is the same alone, in a batch of
other rows at any position, beside wider block tables, and (attention) whatever chunk its query came in.

CPU: the Triton kernels under TRITON_INTERPRET=1 (tests/conftest.py) at small shapes, and the torch path's
row-wise attention; GPU (`-m gpu`): the GEMM at the 8B's shapes.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ostinato.attention.base import AttentionMetadata  # noqa: E402
from ostinato.attention.torch_ref import TorchRefBackend  # noqa: E402
from ostinato.attention.triton_paged import (  # noqa: E402
    TritonAttentionTuning, TritonPagedBackend, batch_invariant_tuning)
from ostinato.kernels.pdl import pdl_unsupported_reason  # noqa: E402
from ostinato.kernels.invariant_linear import INVARIANT_TILES, invariant_gemm, rowwise_linear  # noqa: E402
from ostinato.kernels.split_gemm import SplitTiles  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK, KV_HEADS, GROUP, DIM = 16, 2, 2, 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_matches_float64(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 72, generator=gen).to(dtype)
    w = torch.randn(40, 72, generator=gen).to(dtype)
    b = torch.randn(40, generator=gen).to(dtype)
    out = invariant_gemm(x.to(DEVICE), w.to(DEVICE), b.to(DEVICE), tiles=SplitTiles(16, 16))
    ref = F.linear(x.double(), w.double(), b.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu().double(), ref, rtol=tol, atol=tol * 72 ** 0.5)
    logits = invariant_gemm(x.to(DEVICE), w.to(DEVICE), out_dtype=torch.float32)
    assert logits.dtype == torch.float32


def _row_in_batches(linear, dtype, k=600, n=70):
    """Row 0's output alone, then placed at several positions among 2..69 other rows: all must be equal."""
    # K 600 at the default tiles: 3 splits, the last ragged (SplitTiles.split)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=gen).to(dtype).to(DEVICE)
    row = torch.randn(1, k, generator=gen).to(dtype).to(DEVICE)
    alone = linear(row, w)
    results = []
    for m, pos in [(3, 2), (17, 0), (17, 16), (70, 33)]:
        x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
        x[pos] = row[0]
        results.append(linear(x, w)[pos])
    return alone[0], results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_row_is_the_same_in_every_batch(dtype):
    alone, batched = _row_in_batches(lambda x, w: invariant_gemm(x, w), dtype)
    for out in batched:
        assert torch.equal(out, alone)


# 24 outputs, K 72: 2 N tiles (the second ragged), 5 K tiles (the last ragged), row tiles of 16. "split": 5
# splits, in parallel at every row count tested; "unsplit": one; "parallel then serial": 3 splits of 2, 2 and 1
# K tiles, in parallel up to 2 row tiles (32 rows), one after another from 3; "wider row tiles": as "split", the
# row tile 16 to 128 by the row count.
_SMALL = dict(block_n=16, block_k=16, max_row_tile=16)
SPLIT_TILES = {"split": SplitTiles(**_SMALL, min_split_k_tiles=1),
               "unsplit": SplitTiles(**_SMALL, split_programs=1),
               "parallel then serial": SplitTiles(**_SMALL, split_programs=6, min_split_k_tiles=1),
               "wider row tiles": SplitTiles(**{**_SMALL, "max_row_tile": 128}, min_split_k_tiles=1)}


def test_split_depends_on_n_and_k_only():
    """The K split of the default tiles at a small model's decode projections, and none where N alone gives
    enough programs (the lm_head); whole K tiles per split, at least min_split_k_tiles, none left empty."""
    assert INVARIANT_TILES.split(1024, 2048) == (4, 512)  # o_proj of a 1024-wide model: 16 N tiles alone
    assert INVARIANT_TILES.split(1024, 3072) == (6, 512)
    assert INVARIANT_TILES.split(4096, 1024) == (2, 512)
    assert INVARIANT_TILES.split(6144, 1024) == (2, 512)
    assert replace(INVARIANT_TILES, min_split_k_tiles=1).split(1024, 2048) == (16, 128)
    assert INVARIANT_TILES.split(151936, 1024) == (1, 1024)
    for n, k in [(70, 200), (40, 72), (4096, 14336), (100, 65)]:
        splits, per = INVARIANT_TILES.split(n, k)
        assert per % 128 == 0 and (splits - 1) * per < k <= splits * per


@pytest.mark.parametrize("case", list(SPLIT_TILES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_row_is_the_same_for_every_row_count(case, dtype):
    """A row alone, then last after 1, 15, 16 and 39 other rows (one and several row tiles; and 79 at the wider
    row tiles, where 80 rows take the widest, 128), and first before padding rows of zeros, with a bias, in the
    dtype and in fp32 (the logits): bitwise equal, split or not, splits in parallel or one after another; and
    close to float64."""
    tiles = SPLIT_TILES[case]
    gen = torch.Generator().manual_seed(3)
    k, n = 72, 24
    w = torch.randn(n, k, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE)
    x = torch.randn(80, k, generator=gen).to(dtype).to(DEVICE)
    assert tiles.split(n, k)[0] == {"split": 5, "unsplit": 1, "parallel then serial": 3,
                                               "wider row tiles": 5}[case]
    # 80 rows at 16-row tiles are 5 tiles where 40 are 3: the same launch, only more programs.
    row_counts = (2, 16, 17, 40, 80) if case == "wider row tiles" else (2, 16, 17, 40)
    # fp32 activations: out_dtype fp32 is the launch of out_dtype None.
    for out_dtype in (None,) if dtype == torch.float32 else (None, torch.float32):
        alone = invariant_gemm(x[:1], w, b, out_dtype=out_dtype, tiles=tiles)[0]
        for m in row_counts:
            rows = torch.cat([x[1:m], x[:1]])  # the row last, after m - 1 others
            assert torch.equal(invariant_gemm(rows, w, b, out_dtype=out_dtype, tiles=tiles)[m - 1], alone), m
        padded = torch.cat([x[:1], torch.zeros(20, k, dtype=dtype, device=DEVICE)])
        assert torch.equal(invariant_gemm(padded, w, b, out_dtype=out_dtype, tiles=tiles)[0], alone)
        ref = F.linear(x[:1].double(), w.double(), b.double())[0]
        tol = 1e-5 if dtype == torch.float32 and out_dtype is None else 2e-2
        torch.testing.assert_close(alone.cpu().double(), ref.cpu(), rtol=tol, atol=tol * k ** 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rowwise_linear_row_is_the_same_in_every_batch(dtype):
    alone, batched = _row_in_batches(lambda x, w: rowwise_linear(x.cpu(), w.cpu()), dtype)
    for out in batched:
        assert torch.equal(out, alone)


# ---- attention -------------------------------------------------------------------------------------------

class Streams:
    """Per-sequence K/V token streams written into shuffled blocks of one pool, NaN everywhere else (a read of a
    slot outside a row's context poisons it). `table_width` pads every block table (wider tables: bigger batches
    or graphs)."""

    def __init__(self, lengths: list[int], dtype: torch.dtype, seed: int = 0, table_width: int = 0):
        gen = torch.Generator().manual_seed(seed)
        blocks = [-(-n // BLOCK) for n in lengths]
        total = sum(blocks) + 2
        self.k = torch.full((total + 1, BLOCK, KV_HEADS, DIM), float("nan"), dtype=dtype)
        self.v = torch.full_like(self.k, float("nan"))
        width = max(max(blocks), table_width)
        self.tables = torch.full((len(lengths), width), total, dtype=torch.int32)  # unused: the scratch block
        perm = torch.randperm(total, generator=gen).tolist()
        for s, n in enumerate(lengths):
            own = [perm.pop() for _ in range(blocks[s])]
            self.tables[s, :len(own)] = torch.tensor(own, dtype=torch.int32)
            for p in range(n):
                key = torch.Generator().manual_seed(1000 * s + p)  # a token's K/V depends on (s, p) only
                kv = torch.randn(2, KV_HEADS, DIM, generator=key).to(dtype)
                self.k[own[p // BLOCK], p % BLOCK] = kv[0]
                self.v[own[p // BLOCK], p % BLOCK] = kv[1]


def _query(seq: int, pos: int, dtype) -> torch.Tensor:
    return torch.randn(KV_HEADS * GROUP, DIM, generator=torch.Generator().manual_seed(7 + 1000 * seq + pos)).to(dtype)


def _decode(backend, streams: Streams, lengths: list[int], dtype) -> torch.Tensor:
    """Each sequence's next query (position length - 1 of the same stream) attended by decode()."""
    q = torch.stack([_query(0, n - 1, dtype) for n in lengths]).to(DEVICE)
    meta = AttentionMetadata(False, torch.zeros(len(lengths), dtype=torch.int64, device=DEVICE),
                             streams.tables.to(DEVICE), torch.tensor(lengths, dtype=torch.int32, device=DEVICE))
    return backend.decode(q, streams.k.to(DEVICE), streams.v.to(DEVICE), meta, DIM ** -0.5).cpu()


def _prefill(backend, streams: Streams, chunks: list[tuple[int, int]], dtype) -> torch.Tensor:
    """chunks: (cached, new) per sequence; sequence s's queries are stream 0's at positions cached..cached+new."""
    q = torch.cat([torch.stack([_query(0, c + i, dtype) for i in range(n)]) for c, n in chunks]).to(DEVICE)
    lens = [n for _, n in chunks]
    ctx = [c + n for c, n in chunks]
    starts = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    meta = AttentionMetadata(True, torch.zeros(sum(lens), dtype=torch.int64, device=DEVICE), streams.tables.to(DEVICE),
                             torch.tensor(ctx, dtype=torch.int32, device=DEVICE), starts, lens, ctx, max(lens),
                             max(ctx))
    return backend.prefill(q, streams.k.to(DEVICE), streams.v.to(DEVICE), meta, DIM ** -0.5).cpu()


def _backends():
    return [pytest.param(TorchRefBackend(batch_invariant=True), id="torch"),
            pytest.param(TritonPagedBackend(batch_invariant_tuning(TritonAttentionTuning())), id="triton")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", _backends())
def test_decode_row_is_the_same_in_every_batch(backend, dtype):
    """Sequence 0 (the same stream everywhere: 150 tokens) alone, then beside longer and shorter rows and in
    wider tables: its output row stays the same bits."""
    alone = _decode(backend, Streams([150], dtype), [150], dtype)[0]
    for others, width in [([7, 230], 0), ([150, 150], 24), ([1, 2], 40)]:
        lengths = [150] + others
        streams = Streams(lengths, dtype, table_width=width)
        out = _decode(backend, streams, lengths, dtype)
        assert torch.equal(out[0], alone), (others, width)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", _backends())
def test_prefill_row_is_the_same_whatever_the_chunking(backend, dtype):
    """A 40-token prompt in one chunk, in chunks of 16 + 16 + 8 (a cached prefix each time), and beside another
    sequence: the rows of its last chunk are the same bits every way."""
    streams = Streams([40], dtype)
    whole = _prefill(backend, streams, [(0, 40)], dtype)[32:]
    assert torch.equal(_prefill(backend, streams, [(32, 8)], dtype), whole)
    assert torch.equal(_prefill(backend, streams, [(24, 16)], dtype)[8:], whole)
    beside = Streams([40, 70], dtype, table_width=9)
    assert torch.equal(_prefill(backend, beside, [(32, 8), (0, 70)], dtype)[:8], whole)


def test_torch_decode_row_equals_the_prefill_row_at_its_position():
    """On the torch path a decode row and a prefill row at the same position are one computation."""
    backend = TorchRefBackend(batch_invariant=True)
    streams = Streams([40], torch.float32)
    decoded = _decode(backend, streams, [40], torch.float32)[0]
    assert torch.equal(_prefill(backend, streams, [(0, 40)], torch.float32)[39], decoded)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096),
                                 (4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)])
def test_gemm_8b_and_06b_shapes_row_invariant_and_close_to_cublas(n, k):
    """The 8B's and Qwen3-0.6B's qkv, o, gate_up, down and lm_head (split over K or not): the rows of an 1100-row
    call equal themselves computed in calls of 1 to 300 rows from two offsets (bf16, fp32 logits for the
    lm_head), launched with PDL too, and the GEMM is as close to cuBLAS as two fp32 accumulations are. The row
    counts cover each row tile (16 to 128 MMA columns), the first weight tile loaded before the PDL wait (up
    to 16 rows) and not, and split shapes' parallel launch (few row tiles) and serial one (1100 rows): the bits
    must not change."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * k ** -0.5
    out_dtype = torch.float32 if n in (128256, 151936) else None
    x = torch.randn(1100, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    full = invariant_gemm(x, w, out_dtype=out_dtype)
    pdl_options = (False, True) if pdl_unsupported_reason(x.device) is None else (False,)
    for m in (1, 2, 7, 16, 17, 33, 64, 65, 300):
        for start in (0, 5):
            for pdl in pdl_options:
                part = invariant_gemm(x[start:start + m], w, out_dtype=out_dtype, pdl=pdl)
                assert torch.equal(part, full[start:start + m]), (m, start, pdl)
    torch.testing.assert_close(full.float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2)


def test_invariant_decode_settings_fix_the_split_count_and_its_own_merge_tile():
    """Under --batch-invariant the decode attention splits a fixed number of ways whatever the batch, with one warp
    count, RoPE in its own kernel, and the merge tile sized for that split count, as the GPU invariance tests
    ran it (the default sizes it for max_splits, which would change the merge's bits)."""
    from ostinato.kernels.decode_plan import INVARIANT_DECODE_SPLITS, DecodeTuning, invariant_decode_tuning

    tuning = invariant_decode_tuning(DecodeTuning())
    assert DecodeTuning().merge_tile_for_max_splits and not tuning.merge_tile_for_max_splits
    assert tuning.splits == INVARIANT_DECODE_SPLITS and not tuning.apply_rope
    assert tuning.merge_slices(INVARIANT_DECODE_SPLITS) == INVARIANT_DECODE_SPLITS


def test_quantized_projection_is_refused_with_a_clear_error():
    """A quantized projection picks its kernel by row count (kernels/quantized_linear.py): the mode refuses it."""
    from ostinato.errors import ConfigError
    from ostinato.kernels.invariant_linear import gemm_linear, rowwise_layer_linear
    from ostinato.kernels.quantized_linear import QuantizedLinear

    class Fake(QuantizedLinear):
        def linear(self, x, pdl=False):
            return x

    for linear in (gemm_linear, rowwise_layer_linear):
        with pytest.raises(ConfigError, match="--batch-invariant supports unquantized checkpoints only"):
            linear(torch.zeros(1, 4), Fake())
