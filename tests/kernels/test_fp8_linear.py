"""FP8 weights (kernels/fp8_linear.py, fp8_gemv.py, fp8_mma.py, fp8_w8a8.py, split_gemm.py): the W8A16 GEMV, the
tensor-core kernel, the W8A8 few-rows kernel and the split GEMM against a float64 dequantize-then-matmul reference,
the scale layouts, per-channel and per-token quantization (the one-kernel version against the torch ops), the path
rule and its table of measured shapes.

CPU: under TRITON_INTERPRET=1 (tests/conftest.py), which loads float8_e4m3fn tensors as they are; small ragged
shapes. GPU (`-m gpu`): the real projection shapes, the GEMV with PDL, _scaled_mm, the quantization's rounding,
table entries of each kernel, and a captured graph.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ostinato.kernels import fp8_linear  # noqa: E402
from ostinato.kernels.fp8_linear import (FP8_DTYPE, FP8_GEMV_MAX_ROWS, FP8_MAX, Fp8Linear, Fp8Tiles,  # noqa: E402
                                         MmaTiles, SplitTiles, SplitW8a8, choose_fp8_path, dequantize_fp8, fp8_gemv,
                                         fp8_mma, StreamTiles, W8a8Tiles, fp8_w8a8, quantize_per_token, quantize_rows,
                                         quantize_tokens, split_gemm)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _random_fp8(n: int, k: int, block, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 weights spread over E4M3's range, with scales of the layout (per row, or per block)."""
    w = (torch.randn(n, k, generator=gen) * 64).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    shape = (n,) if block is None else (-(-n // block[0]), -(-k // block[1]))
    return w, torch.rand(shape, generator=gen) * 0.01 + 1e-3


def _reference(x, w, scale, block, b):
    dense = dequantize_fp8(w, scale, block).double()
    return F.linear(x.double(), dense, None if b is None else b.double())


def _inputs(m: int, n: int, k: int, block, bias: bool, dtype: torch.dtype, seed: int):
    """(fp8 weight, its scales, x [m, k], bias or None) on the CPU, random from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    w, scale = _random_fp8(n, k, block, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    return w, scale, x, torch.randn(n, generator=gen).to(dtype) if bias else None


def _device(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(DEVICE)


def _assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(out.cpu().double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


# Ragged: N and K not multiples of the tiles nor of the scale blocks; M below and at its padded size; K inside
# one tile and across several; blocks narrower and wider than a K tile; two K tiles a step, with K a multiple of
# the step (no K mask), of one tile but not of the step, and of neither.
@pytest.mark.parametrize("m,n,k,tiles,block,bias", [
    (1, 37, 100, Fp8Tiles(4, 32), None, False),
    (1, 37, 128, Fp8Tiles(4, 32, k_tiles=2), None, False),
    (2, 21, 96, Fp8Tiles(8, 32, k_tiles=2), None, True),
    (3, 19, 150, Fp8Tiles(2, 32, k_tiles=2), (8, 32), True),
    (3, 50, 257, Fp8Tiles(2, 128), None, True),
    (4, 9, 64, Fp8Tiles(8, 64), None, True),
    (1, 37, 300, Fp8Tiles(2, 128), (16, 32), True),
    (5, 24, 130, Fp8Tiles(1, 64), (8, 128), False),
    (16, 20, 96, Fp8Tiles(2, 32), (4, 16), True),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_gemv_matches_float64_reference(m, n, k, tiles, block, bias, dtype):
    w, scale, x, b = _inputs(m, n, k, block, bias, dtype, seed=m * 1000 + n + k)
    out = fp8_gemv(_device(x), _device(w), _device(scale), _device(b), tiles, block)
    assert out.shape == (m, n) and out.dtype == dtype
    _assert_close(out, _reference(x, w, scale, block, b), 1e-5 if dtype == torch.float32 else 8e-3)  # bf16 rounding


# The tensor-core kernel: rows and columns past one tile and ragged; block scales whose blocks hold 1 and 2 tiles.
@pytest.mark.parametrize("m,n,k,block,bias", [
    (37, 40, 72, None, True),
    (20, 48, 64, (16, 32), False),
    (17, 33, 50, (32, 16), True),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_mma_matches_float64_reference(m, n, k, block, bias, dtype):
    w, scale, x, b = _inputs(m, n, k, block, bias, dtype, seed=m + n + k)
    out = fp8_mma(_device(x), _device(w), _device(scale), _device(b), block, tile=MmaTiles(16, 16, 16))
    # fp32 inputs may run as tf32 on the tensor cores; bf16: the weight widened to bf16 after its block scale
    tol = 2e-3 if dtype == torch.float32 and DEVICE == "cuda" else (1e-5 if dtype == torch.float32 else 8e-3)
    _assert_close(out, _reference(x, w, scale, block, b), tol)


# The split GEMM on FP8 weights (W8A16, per-row scales): one row tile and several; K split in parallel, one split
# after another, and unsplit; N and K ragged against the tiles.
@pytest.mark.parametrize("m,n,k,tiles,bias", [
    (1, 37, 100, SplitTiles(16, 16, min_split_k_tiles=1), False),
    (5, 40, 256, SplitTiles(16, 32, max_row_tile=16, split_programs=8, min_split_k_tiles=1), True),
    (20, 17, 90, SplitTiles(16, 16, max_row_tile=16, split_programs=1), True),
    (40, 33, 200, SplitTiles(32, 16, max_row_tile=16, split_programs=4, min_split_k_tiles=2), False),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_gemm_on_fp8_weights_matches_float64_reference(m, n, k, tiles, bias, dtype):
    w, scale, x, b = _inputs(m, n, k, None, bias, dtype, seed=m + n + k)
    out = split_gemm(_device(x), _device(w), _device(b), tiles, scale=_device(scale))
    assert out.shape == (m, n) and out.dtype == dtype
    # fp32: the weight widens exactly; bf16: the output's own rounding
    _assert_close(out, _reference(x, w, scale, None, b), 1e-5 if dtype == torch.float32 else 8e-3)


# Block scales: blocks as wide as a K step and two steps wide, rows blocks narrower and wider than a program's;
# K split in parallel, one split after another, and unsplit; N and K ragged against the blocks.
@pytest.mark.parametrize("m,n,k,block,tiles", [
    (1, 37, 100, (8, 32), SplitTiles(16, 16, min_split_k_tiles=1)),
    (5, 40, 256, (32, 32), SplitTiles(16, 32, max_row_tile=16, split_programs=8, min_split_k_tiles=1)),
    (20, 17, 90, (4, 16), SplitTiles(16, 16, max_row_tile=16, split_programs=1)),
    (40, 70, 200, (64, 32), SplitTiles(32, 16, max_row_tile=16, split_programs=4, min_split_k_tiles=2)),
])
def test_split_gemm_with_block_scales_matches_float64_reference(m, n, k, block, tiles):
    w, scale, x, b = _inputs(m, n, k, block, True, torch.bfloat16, seed=m + n + k)
    out = split_gemm(_device(x), _device(w), _device(b), tiles, scale=_device(scale), block=block)
    _assert_close(out, _reference(x, w, scale, block, b), 8e-3)


# W8A8: rows below and above one 16-row tile; N and K ragged against the tiles; one K step and several.
@pytest.mark.parametrize("m,n,k,tiles,bias", [
    (1, 37, 100, W8a8Tiles(16, 32), False),
    (5, 40, 256, W8a8Tiles(32, 64), True),
    (20, 17, 90, W8a8Tiles(16, 64), True),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_w8a8_matches_float64_reference_on_the_quantized_activations(m, n, k, tiles, bias, dtype):
    gen = torch.Generator().manual_seed(m * 7 + n + k)
    w, scale = _random_fp8(n, k, None, gen)
    xq, x_scale = quantize_per_token(torch.randn(m, k, generator=gen))
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    out = fp8_w8a8(xq.to(DEVICE), x_scale.to(DEVICE), w.to(DEVICE), scale.to(DEVICE),
                   None if b is None else b.to(DEVICE), tiles, dtype)
    assert out.shape == (m, n) and out.dtype == dtype
    ref = _reference(xq.double() * x_scale.double(), w, scale, None, b)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(out.cpu().double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


# The split GEMM on FP8 activations (W8A8): the parallel splits (few tiles) and the serial launch (enough row tiles
# to fill the programs), N and K ragged against the tiles.
@pytest.mark.parametrize("m,n,k,tiles,bias", [
    (3, 70, 200, SplitTiles(32, 32, max_row_tile=16, split_programs=8, min_split_k_tiles=2), True),
    (40, 37, 96, SplitTiles(16, 32, max_row_tile=16, split_programs=4, min_split_k_tiles=1), False),
])
def test_split_gemm_w8a8_matches_float64_reference_on_the_quantized_activations(m, n, k, tiles, bias):
    gen = torch.Generator().manual_seed(m * 3 + n + k)
    w, scale = _random_fp8(n, k, None, gen)
    xq, x_scale = quantize_per_token(torch.randn(m, k, generator=gen))
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    out = split_gemm(xq.to(DEVICE), w.to(DEVICE), _device(b), tiles, scale=scale.to(DEVICE),
                     out_dtype=torch.bfloat16, x_scale=x_scale.to(DEVICE))
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    _assert_close(out, _reference(xq.double() * x_scale.double(), w, scale, None, b), 8e-3)


def test_block_dequantize_scales_each_block_by_its_own_factor():
    w = torch.ones(5, 7).to(FP8_DTYPE)
    scale = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])  # blocks 2 x 4: rows 0-1, 2-3, 4; cols 0-3, 4-6
    dense = dequantize_fp8(w, scale, (2, 4))
    assert dense[1, 3] == 1 and dense[1, 4] == 2 and dense[2, 0] == 3 and dense[3, 6] == 4 and dense[4, 6] == 6


def test_quantize_rows_is_per_channel_and_within_e4m3_rounding():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(6, 64, generator=gen) * torch.tensor([1e-3, 0.1, 1, 10, 100, 1e4])[:, None]
    q, scale = quantize_rows(w)
    assert q.dtype == FP8_DTYPE and scale.shape == (6,)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((6,), FP8_MAX))  # each row's max maps to 448
    back = dequantize_fp8(q, scale, None)
    # E4M3 keeps 3 mantissa bits: a relative error of at most 2^-4 for every value in the normal range
    big = w.abs() > scale[:, None] * 2 ** -6
    assert ((back - w).abs() <= w.abs() * 2 ** -4 + 1e-12)[big].all()


def test_path_rule():
    assert choose_fp8_path(1, 4096, 4096, False, cuda=True) == StreamTiles(4, 2048)
    assert choose_fp8_path(1, 28672, 4096, False, cuda=True) == StreamTiles(8, 2048)
    assert choose_fp8_path(3, 28672, 4096, False, cuda=True) == StreamTiles(4, 2048)  # one accumulator a row
    assert choose_fp8_path(4, 28672, 4096, False, cuda=True) == SplitTiles(block_k=256)  # W read once for 4 rows
    assert choose_fp8_path(1, 3072, 1024, False, cuda=True) == StreamTiles(4, 1024)
    assert isinstance(choose_fp8_path(1, 4096, 4096, False, cuda=True, bf16=False), Fp8Tiles)
    assert isinstance(choose_fp8_path(1, 4096, 4098, False, cuda=True), Fp8Tiles)  # K not whole words
    assert choose_fp8_path(1, 4096, 4096, True, cuda=True) == StreamTiles(4, 2048)  # block scales stream too
    assert choose_fp8_path(2, 4096, 4096, True, cuda=True) == StreamTiles(4, 2048)
    assert choose_fp8_path(3, 4096, 4096, True, cuda=True) == SplitTiles(block_k=128)  # a scale per block a row
    # fp16 activations, or x's rows not words, at the rows the split GEMM takes in bf16: still the first GEMV
    assert isinstance(choose_fp8_path(FP8_GEMV_MAX_ROWS, 4096, 4096, False, cuda=True, bf16=False), Fp8Tiles)
    assert isinstance(choose_fp8_path(2, 4096, 4096, True, cuda=True, stream=False), Fp8Tiles)
    # x's rows not readable as words (Fp8Linear's fallback): the first GEMV, block scales or not
    assert isinstance(choose_fp8_path(1, 4096, 4096, True, cuda=True, stream=False), Fp8Tiles)
    assert isinstance(choose_fp8_path(1, 4096, 4096, False, cuda=True, stream=False), Fp8Tiles)
    assert choose_fp8_path(FP8_GEMV_MAX_ROWS + 1, 4096, 4096, False, cuda=True) == SplitTiles(block_k=256)
    assert choose_fp8_path(16, 4096, 4096, False, cuda=True) == SplitTiles(block_k=256)
    assert choose_fp8_path(17, 4096, 4096, False, cuda=True) == SplitW8a8()  # FP8 activations, K split
    assert choose_fp8_path(64, 4096, 14336, False, cuda=True) == SplitW8a8()
    assert choose_fp8_path(65, 4096, 4096, False, cuda=True) == "scaled_mm"
    assert choose_fp8_path(17, 3072, 2048, False, cuda=True) == SplitTiles(block_k=256)  # narrow: few 128-wide tiles
    assert choose_fp8_path(64, 2048, 8192, False, cuda=True) == SplitTiles(block_k=256)
    assert choose_fp8_path(65, 2048, 8192, False, cuda=True) == "scaled_mm"
    assert choose_fp8_path(64, 16384, 2048, False, cuda=True) == SplitW8a8()
    assert choose_fp8_path(16, 4096, 4096, True, cuda=True) == SplitTiles(block_k=128)  # block scales, few rows
    assert choose_fp8_path(64, 3072, 2048, True, cuda=True) == SplitTiles(block_k=128)  # block scales, narrow
    assert choose_fp8_path(64, 4096, 4096, True, cuda=True) == MmaTiles()  # block scales above 16 rows
    assert choose_fp8_path(64, 4096, 4100, False, cuda=True) == "dequantize"  # _scaled_mm needs K % 16 == 0
    assert choose_fp8_path(64, 4096, 4096, False, cuda=True, bf16=False) == "dequantize"
    assert choose_fp8_path(1, 4096, 4096, False, cuda=False) == "dequantize"
    for m in range(1, FP8_GEMV_MAX_ROWS + 1):  # the accumulator stays within the register budget at every row count
        tiles = choose_fp8_path(m, 6144, 4096, True, cuda=True, bf16=False)  # fp16: the first GEMV at every row
        assert triton_next_pow2(m) * tiles.block_n * tiles.block_k <= 8192
    # one row: as many bytes in flight a step as the bf16 GEMV's 8 x 1024 tile of two-byte weights
    tiles = choose_fp8_path(1, 6144, 4096, True, cuda=True, stream=False)
    assert tiles.block_n * tiles.block_k * tiles.k_tiles == 8 * 1024 * 2


def test_measured_table_overrides_the_rule_at_its_exact_shape_only(monkeypatch):
    tile = MmaTiles(16, 128, 128)
    monkeypatch.setitem(fp8_linear.FP8_MEASURED, (16, 6144, 4096), tile)
    assert choose_fp8_path(16, 6144, 4096, False, cuda=True) == tile
    assert choose_fp8_path(8, 6144, 4096, False, cuda=True) == SplitTiles(block_k=256)  # other rows: the rule
    assert choose_fp8_path(16, 6144, 4096, True, cuda=True) == SplitTiles(block_k=128)  # measured per-row only
    assert choose_fp8_path(16, 6144, 4096, False, cuda=False) == "dequantize"


def test_measured_entries_are_configs_the_kernels_take():
    """FP8_MEASURED is filled by hand from the sweep's output: each entry must be a config its kernel accepts."""
    for (m, n, k), config in fp8_linear.FP8_MEASURED.items():
        if isinstance(config, StreamTiles):
            assert m <= 4 and config.prefetch in (1, 2) and config.block_k % 4 == 0
        elif isinstance(config, Fp8Tiles):
            assert m <= 16 and config.k_tiles in (1, 2)
            assert triton_next_pow2(m) * config.block_n * config.block_k <= 16384
        elif isinstance(config, MmaTiles):
            assert min(config.block_m, config.block_n, config.block_k) >= 16
        elif isinstance(config, W8a8Tiles):
            assert config.block_n >= 16 and config.block_k >= 32
        elif isinstance(config, SplitTiles):
            assert min(config.block_n, config.block_k, config.min_row_tile) >= 16
        elif isinstance(config, SplitW8a8):
            assert min(config.tiles.block_n, config.tiles.block_k, config.tiles.min_row_tile) >= 16
        else:
            assert config == "scaled_mm" and n % 16 == 0 and k % 16 == 0, (m, n, k, config)


@pytest.mark.parametrize("m,k", [(1, 40), (3, 100), (5, 2048 + 37), (2, 16384 + 37)])  # the last: in pieces
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_tokens_kernel_equals_the_torch_ops(m, k, dtype):
    """Rows of E4M3 values times a power of two per row, each row's largest magnitude 448 times it: the scale is
    that power and the codes are the values, exactly, whatever rounding the division would need. (The Triton
    interpreter rounds fp32 -> E4M3 wrongly where the rounding carries into the exponent, 126.8 -> 64; the GPU
    test below compares rounded values on the hardware.) Row 0 is all zeros: the floor scale, zero codes."""
    gen = torch.Generator().manual_seed(m + k)
    codes = (torch.randn(m, k, generator=gen) * 100).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    codes[:, k // 2] = FP8_MAX
    codes[0] = 0.0
    powers = 2.0 ** torch.arange(-6, m - 6, dtype=torch.float32)[:, None]
    x = (codes.float() * powers).to(dtype)
    q, scale = quantize_tokens(x.to(DEVICE))
    ref_q, ref_scale = quantize_per_token(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (m, 1)
    torch.testing.assert_close(scale.cpu(), ref_scale, rtol=1e-6, atol=0)
    assert torch.equal(q.cpu().view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(q.cpu().view(torch.uint8), codes.view(torch.uint8))


def triton_next_pow2(m: int) -> int:
    return 1 << (m - 1).bit_length()


def _layer(n, k, block, bias, gen, device="cpu"):
    layer = Fp8Linear(k, n, bias, block)
    w, scale = _random_fp8(n, k, block, gen)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.weight_scale.copy_(scale)
        if bias:
            layer.bias.copy_(torch.randn(n, generator=gen))
    return layer.to(device)


@pytest.mark.parametrize("block", [None, (8, 16)])
def test_cpu_linear_is_dequantize_then_matmul(block):
    gen = torch.Generator().manual_seed(3)
    layer = _layer(24, 40, block, True, gen)
    x = torch.randn(5, 40, generator=gen)
    torch.testing.assert_close(layer(x).double(), _reference(x, layer.weight, layer.weight_scale, block, layer.bias),
                               rtol=1e-5, atol=1e-4)
    scales = 24 if block is None else 3 * 3
    assert layer.weight_bytes() == 24 * 40 + 4 * scales + 24 * layer.bias.element_size()  # bias too: a forward reads it


# ---- GPU: the real kernels at the public models' projection shapes ------------------------------------------

SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (3072, 1024), (3072, 2048), (2048, 2048), (16384, 2048),
          (2048, 8192), (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def _relative_error(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 4, 8, 16, 64, 256])
@pytest.mark.parametrize("block", [None, (128, 128)])
def test_every_path_at_the_real_projection_shapes(m, n, k, block):
    gen = torch.Generator().manual_seed(n + k)
    layer = _layer(n, k, block, False, gen, "cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = _reference(x.cpu(), layer.weight.cpu(), layer.weight_scale.cpu(), block, None).cuda()
    # W8A16 keeps x in bf16: bf16's output rounding; _scaled_mm and the W8A8 split GEMM also round x to fp8
    # (per-token scales)
    path = choose_fp8_path(m, n, k, block is not None, True)
    limit = 5e-2 if path == "scaled_mm" or isinstance(path, SplitW8a8) else 1e-2
    assert _relative_error(layer.linear(x, pdl=True), ref) < limit


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 8, 64, 128])  # the streaming GEMV, the split GEMM (W8A16, W8A8), _scaled_mm
def test_fp8_linear_replays_in_a_cuda_graph(m):
    gen = torch.Generator().manual_seed(1)
    layer = _layer(6144, 4096, None, False, gen, "cuda")
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    eager = layer.linear(x, pdl=True)  # compiles before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer.linear(x, pdl=True)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, layer.linear(x, pdl=True)) and not torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m,k", [(1, 4096), (64, 14336), (37, 1000), (3, 16384 + 37)])
def test_quantize_tokens_kernel_rounds_as_torch_does_on_the_gpu(m, k):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * torch.logspace(-3, 3, m, device="cuda")[:, None]
    q, scale = quantize_tokens(x)
    ref_q, ref_scale = quantize_per_token(x)
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("config", [W8a8Tiles(16, 512), W8a8Tiles(64, 256), MmaTiles(16, 64, 256),
                                    Fp8Tiles(8, 1024, k_tiles=2), SplitTiles(), SplitTiles(block_k=256)])
@pytest.mark.parametrize("m", [1, 16])
def test_a_measured_table_entry_runs_its_kernel_at_the_real_shape(monkeypatch, config, m):
    gen = torch.Generator().manual_seed(2)
    layer = _layer(6144, 4096, None, True, gen, "cuda")
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    ref = _reference(x.cpu(), layer.weight.cpu(), layer.weight_scale.cpu(), None, layer.bias.cpu()).cuda()
    monkeypatch.setitem(fp8_linear.FP8_MEASURED, (m, 6144, 4096), config)
    limit = 5e-2 if isinstance(config, W8a8Tiles) else 1e-2  # W8A8 rounds x to E4M3 too
    assert _relative_error(layer.linear(x, pdl=True), ref) < limit
