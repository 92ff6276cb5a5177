"""GGUF blocks kept quantized: the torch dequantizers equal the `gguf` library's, and the Triton kernels (GEMV at
a few rows; above, the dense slices multiplied by torch.mm, or the tensor-core GEMM) equal its
dequantize-then-matmul in float64, for every type with a kernel."""

import numpy as np
import pytest
import torch

gguf_quants = pytest.importorskip("gguf.quants")

from ostinato.kernels.gguf_linear import (KERNEL_TYPES, PADDED_BLOCK_BYTES, PLANE_FIELDS, Q6_K, Q8_0,  # noqa: E402
                                          GGUFConcat, GGUFLinear, dequantize_blocks, device_row_bytes, device_rows,
                                          file_rows)
from ostinato.tools.checkpoint_gguf import random_blocks  # noqa: E402

TYPES = sorted(KERNEL_TYPES, key=lambda t: KERNEL_TYPES[t][0])


def _blocks(qtype, n, k, seed=0):
    return random_blocks(KERNEL_TYPES[qtype][0], n, k, np.random.default_rng(seed))


def _rows(blocks: np.ndarray, qtype: int) -> torch.Tensor:
    """The file's rows as the kernels take them."""
    return device_rows(torch.from_numpy(blocks), qtype)


def _reference(x: torch.Tensor, blocks: np.ndarray, qtype: int) -> np.ndarray:
    return x.double().numpy() @ gguf_quants.dequantize(blocks, qtype).astype(np.float64).T


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: KERNEL_TYPES[t][0])
def test_torch_dequantize_equals_the_gguf_library(qtype):
    blocks = _blocks(qtype, 3, 512)
    ours = dequantize_blocks(torch.from_numpy(blocks), qtype, 512).numpy()
    np.testing.assert_array_equal(ours, gguf_quants.dequantize(blocks, qtype))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: KERNEL_TYPES[t][0])
def test_device_rows_hold_the_same_bytes_and_undo(qtype):
    """The kernels' rows (planar for PLANE_FIELDS' types, Q8_0; each block padded with zeros for
    PADDED_BLOCK_BYTES', Q6_K; as they are for the rest) give the file's rows back."""
    blocks = torch.from_numpy(_blocks(qtype, 3, 1024))
    rows = device_rows(blocks, qtype)
    assert rows.shape == (3, device_row_bytes(qtype, 1024))
    padding = rows.shape[1] - blocks.shape[1]
    assert padding == (1024 // 256 * 14 if qtype == Q6_K else 0)
    with_padding = torch.cat([blocks.flatten(), torch.zeros(3 * padding, dtype=torch.uint8)])
    assert torch.equal(torch.sort(rows.flatten()).values, torch.sort(with_padding).values)
    assert torch.equal(file_rows(rows, qtype), blocks)
    assert (qtype in PLANE_FIELDS or qtype in PADDED_BLOCK_BYTES) == (not torch.equal(rows[:, :blocks.shape[1]],
                                                                                       blocks))
    if qtype in PADDED_BLOCK_BYTES:
        assert rows.shape[1] // (1024 // 256) % 16 == 0  # every block 16-byte aligned


def test_a_planar_q8_0_row_is_its_codes_then_its_scales():
    """Read the way the kernels read it, a planar Q8_0 row gives the gguf library's weights."""
    n, k = 3, 256
    blocks = _blocks(Q8_0, n, k)
    rows = device_rows(torch.from_numpy(blocks), Q8_0)
    codes = rows[:, :k].view(torch.int8).float()
    d = rows[:, k:].contiguous().view(torch.float16).float()
    assert d.shape == (n, k // 32)
    weights = codes * d.repeat_interleave(32, dim=1)
    np.testing.assert_array_equal(weights.numpy(), gguf_quants.dequantize(blocks, Q8_0))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: KERNEL_TYPES[t][0])
@pytest.mark.parametrize("m", [1, 3, 11])  # GEMV (1, 3 rows: ragged M_PAD) and the dense slices (11)
def test_kernel_equals_dequantize_then_matmul(qtype, m):
    block = KERNEL_TYPES[qtype][1]
    n, k = 5, 2 * 256 + (block if block == 32 else 256)  # ragged: N not a tile multiple, K not of BLOCK_K
    blocks = _blocks(qtype, n, k, seed=m)
    bias = torch.randn(n)
    layer = GGUFLinear(qtype, torch.from_numpy(blocks), k, bias)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    from ostinato.kernels.gguf_gemv import gguf_linear_into

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # without a GPU, the Triton interpreter runs it
    out = torch.empty(m, n, device=dev)
    gguf_linear_into(x.to(dev), layer.blocks.to(dev), qtype, bias.to(dev), out)
    out = out.cpu()
    ref = _reference(x, blocks, qtype) + bias.double().numpy()
    np.testing.assert_allclose(out.double().numpy(), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    torch_path = layer.linear(x)  # CPU tensors: dequantize with torch ops, then matmul
    np.testing.assert_allclose(torch_path.double().numpy(), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: KERNEL_TYPES[t][0])
@pytest.mark.parametrize("m,tiles", [(1, (1, 2, 1, 4)), (1, (1, 8, 4, 8)), (5, (8, 4, 2, 4)), (8, (16, 64, 1, 4)),
                                     (20, (32, 16, 2, 8))], ids=lambda v: str(v))
def test_every_tile_setting_covers_all_of_k_and_n(qtype, m, tiles):
    """The sweep's settings (benchmarks/kernels/gguf_linear.py --sweep) besides choose_tiles's: one group a K step
    (many steps, the last ragged), more rows of W than N, the GEMM's narrowest dot."""
    from ostinato.kernels.gguf_gemv import GGUFTiles, gguf_linear_into

    n, k = 5, 3 * 256
    blocks = _blocks(qtype, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.empty(m, n, device=dev)
    gguf_linear_into(x.to(dev), _rows(blocks, qtype).to(dev), qtype, None, out, tiles=GGUFTiles(*tiles))
    out = out.cpu()
    ref = _reference(x, blocks, qtype)
    np.testing.assert_allclose(out.double().numpy(), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: KERNEL_TYPES[t][0])
def test_dequantize_kernel_equals_the_gguf_library(qtype):
    """Every weight, N not a multiple of the kernel's rows, K ragged against its groups a program."""
    from ostinato.kernels.gguf_gemv import gguf_dequantize_into

    n, k = 11, 3 * 256 + (32 if KERNEL_TYPES[qtype][1] == 32 else 0)
    blocks = _blocks(qtype, n, k, seed=3)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.full((n, k), float("nan"), device=dev)
    gguf_dequantize_into(_rows(blocks, qtype).to(dev), qtype, out)
    np.testing.assert_allclose(out.cpu().numpy(), gguf_quants.dequantize(blocks, qtype), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: KERNEL_TYPES[t][0])
def test_dequantized_gemm_in_slices_writes_only_its_columns(qtype, monkeypatch):
    """The dense slices above GEMV_MAX_ROWS with a scratch of 64 rows: W made in three slices (the last short),
    each multiplied into its columns of a wider output, the bias added per slice; the columns beside stay
    untouched."""
    from ostinato.kernels import gguf_gemv

    n, k = 150, 256
    monkeypatch.setattr(gguf_gemv, "DEQUANT_SCRATCH_BYTES", 64 * k * 4)
    blocks = _blocks(qtype, n, k, seed=4)
    bias = torch.randn(n)
    x = torch.randn(gguf_gemv.GEMV_MAX_ROWS + 1, k)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    wide = torch.full((x.shape[0], n + 7), -5.0, device=dev)
    gguf_gemv.gguf_linear_into(x.to(dev), _rows(blocks, qtype).to(dev), qtype, bias.to(dev), wide[:, 3:3 + n])
    wide = wide.cpu()
    ref = _reference(x, blocks, qtype) + bias.double().numpy()
    np.testing.assert_allclose(wide[:, 3:3 + n].double().numpy(), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    assert (wide[:, :3] == -5).all() and (wide[:, 3 + n:] == -5).all()


def test_concat_of_mixed_types_writes_each_shards_columns():
    from gguf.constants import GGMLQuantizationType as T

    k = 256
    parts = [GGUFLinear(int(t), torch.from_numpy(_blocks(int(t), n, k, seed=n)), k)
             for t, n in ((T.Q4_K, 6), (T.Q6_K, 3), (T.Q8_0, 2))]
    fused = GGUFConcat(parts)
    x = torch.randn(2, k)
    expected = torch.cat([x @ p.dequantize().T for p in parts], dim=1)
    torch.testing.assert_close(fused.linear(x), expected)
    torch.testing.assert_close(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    assert fused.weight_bytes() == sum(p.blocks.numel() for p in parts)


def test_blocks_of_the_wrong_size_are_refused():
    with pytest.raises(ValueError, match=r"\[N, 68\] uint8"):  # Q8_0: 64 inputs are two 34-byte blocks
        GGUFLinear(8, torch.zeros(4, 34, dtype=torch.uint8), 64)
