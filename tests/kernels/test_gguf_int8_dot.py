"""The Q4_K, Q6_K and Q8_0 kernels with int8 activations (kernels/gguf_int8_dot.py, gguf_int8_q6k_q80.py), on the GPU
where there is one, else under the Triton interpreter: the quantized activations equal a numpy float32 quantizer
(bit for bit in the interpreter; the GPU's fast division may move a value sitting on a rounding tie by one code),
the kernel equals a float64 evaluation of its own formula on its own quantized activations, and against the gguf
library's dequantize-then-matmul it is off by what rounding the activations to int8 costs, no more."""

import numpy as np
import pytest
import torch

gguf_quants = pytest.importorskip("gguf.quants")
pytest.importorskip("triton")

from ostinato.kernels.gguf_int8_dot import quantize_x  # noqa: E402
from ostinato.kernels.gguf_int8_q4k import Q4kTiles, q4k_rows_into  # noqa: E402
from ostinato.kernels.gguf_int8_mma import MmaTiles, mma_rows_into  # noqa: E402
from ostinato.kernels.gguf_int8_q6k_q80 import Q6kTiles, Q8Tiles, q6k_rows_into, q80_rows_into  # noqa: E402
from ostinato.kernels.gguf_linear import Q4_0, Q4_K, Q6_K, Q8_0, device_rows  # noqa: E402
from ostinato.tools.checkpoint_gguf import random_blocks  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BY_NAME = {"Q4_K": Q4_K, "Q6_K": Q6_K, "Q8_0": Q8_0}
BY_TYPE = {qtype: name for name, qtype in BY_NAME.items()}


def _quantized(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [K] float32 -> (codes [K] as the kernel rounds them, dx [K / 32]), in float32 as the kernel computes."""
    blocks = x.reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127.0) / np.maximum(amax, np.float32(1e-30)), np.float32(0))
    v = blocks * inv[:, None]
    codes = np.trunc(np.where(v >= 0, v + np.float32(0.5), v - np.float32(0.5)))
    return codes.reshape(-1), amax / np.float32(127.0)


def _parts(blocks: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The Q4_K weights' two parts, W = scale * codes - offset, as float64 [N, K] each: scale = d * sc (per
    sub-block), offset = dmin * mn."""
    def with_codes(value: int) -> np.ndarray:
        b = blocks.copy().reshape(n, k // 256, 144)
        b[:, :, 16:] = value * 17  # both nibbles of every code byte
        return gguf_quants.dequantize(b.reshape(n, -1), Q4_K).astype(np.float64)
    offset = -with_codes(0)
    return with_codes(1) + offset, offset


def _rounded_x(x: torch.Tensor) -> np.ndarray:
    """x [M, K] as quantize_x rounds it, float64: on the GPU its own codes and scales; in the interpreter the numpy
    quantizer, which test_activations_quantize_as_the_formula_says holds equal to it bit for bit there (one
    launch of the quantizer fewer: its programs, a row each, are most of these tests' interpreter time)."""
    if DEV == "cpu":
        codes, dx = zip(*(_quantized(row.float().numpy()) for row in x))
        return np.stack(codes).astype(np.float64) * np.repeat(np.stack(dx).astype(np.float64), 32, axis=1)
    xq, dx, *_ = quantize_x(x.to(DEV))
    codes = xq.cpu().numpy().view(np.int8).astype(np.float64)
    return codes * np.repeat(dx.cpu().numpy().astype(np.float64), 32, axis=1)


def _q4k_formula(x: torch.Tensor, blocks: np.ndarray, n: int, k: int) -> np.ndarray:
    """What the Q4_K kernel computes, [M, N] in float64: scale * (dx * sum (q - 8) xq + 8 sum x) - offset * sum x."""
    scale, offset = _parts(blocks, n, k)
    w = gguf_quants.dequantize(blocks, Q4_K).astype(np.float64)
    centred = (w + offset) - 8 * scale  # scale * (q - 8)
    x64 = x.double().numpy()
    return _rounded_x(x) @ centred.T + x64 @ (8 * scale).T - x64 @ offset.T


def _q6k_formula(x: torch.Tensor, blocks: np.ndarray, n: int, k: int) -> np.ndarray:
    """Q6_K's weights are d * sc * (q - 32), no offset term: W times x as quantize_x rounds it."""
    return _rounded_x(x) @ gguf_quants.dequantize(blocks, Q6_K).astype(np.float64).T


def _q80_formula(x: torch.Tensor, blocks: np.ndarray, n: int, k: int) -> np.ndarray:
    """Q8_0's weights are d * q: W times x as quantize_x rounds it."""
    return _rounded_x(x) @ gguf_quants.dequantize(blocks, Q8_0).astype(np.float64).T


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    x[0, 32:64] = 0  # a 32-block of zeros: scale 0, codes 0
    return x


def test_activations_quantize_as_the_formula_says():
    """Three rows, read from a wider tensor (strided rows), each quantized on its own."""
    m, k = 3, 768
    x = torch.cat([_x(m, k, 0), torch.randn(m, 64).to(torch.bfloat16)], dim=1)[:, :k]
    xq, dx, sx, cx, s16 = (t.cpu().numpy() for t in quantize_x(x.to(DEV)))
    assert xq.shape == (m, k // 4) and dx.shape == sx.shape == cx.shape == (m, k // 32) and s16.shape == (m, k // 16)
    codes, want_dx = zip(*(_quantized(row.float().numpy()) for row in x))
    codes, want_dx = np.stack(codes), np.stack(want_dx)
    got = xq.view(np.int8).astype(np.float32)
    if DEV == "cpu":
        np.testing.assert_array_equal(got, codes)
        np.testing.assert_array_equal(dx, want_dx)
    else:  # the GPU's division is within 2 ulp, not correctly rounded
        assert np.abs(got - codes).max() <= 1 and (got != codes).mean() < 1e-3
        np.testing.assert_allclose(dx, want_dx, rtol=3e-7, atol=0)
    sums = x.double().numpy().reshape(m, -1, 32).sum(axis=2)
    np.testing.assert_allclose(sx, sums, rtol=1e-5, atol=1e-5)
    want_cx = 8 * (sums - want_dx * got.reshape(m, -1, 32).sum(axis=2))
    np.testing.assert_allclose(cx, want_cx, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(s16, got.reshape(m, -1, 16).sum(axis=2))


def _run(kernel, qtype_name, formula, m, n, k, tiles, bias):
    """The kernel on m rows into a column slice of a wider output (its rows strided), against its formula."""
    blocks = random_blocks(qtype_name, n, k, np.random.default_rng(n + k + m))
    x = _x(m, k, n + m)
    b = torch.randn(n) if bias else None
    wide = torch.zeros(m, n + 5, device=DEV)
    rows = device_rows(torch.from_numpy(blocks), BY_NAME[qtype_name]).to(DEV)
    kernel(x.to(DEV), rows, b.to(DEV) if bias else None, wide[:, 2:2 + n], tiles=tiles)
    want = formula(x, blocks, n, k) + (b.double().numpy() if bias else 0)
    got = wide.double().cpu().numpy()
    np.testing.assert_allclose(got[:, 2:2 + n], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert not got[:, :2].any() and not got[:, 2 + n:].any()  # nothing written outside its columns


# (rows of x, N, K, tiles, bias)
@pytest.mark.parametrize("m,n,k,tiles,bias", [(1, 13, 768, Q4kTiles(8, 64), True),  # N ragged, K not a K step multiple
                                              (1, 13, 768, Q4kTiles(4, 32), False),  # K steps of one super-block
                                              (1, 3, 512, Q4kTiles(8, 64), False),  # more rows of W a program than N
                                              (1, 9, 1024, Q4kTiles(4, 128), True),  # the K step divides K: no masks
                                              (3, 13, 768, Q4kTiles(4, 64), True),  # three accumulators
                                              (6, 9, 1024, Q4kTiles(4, 128), False),  # two groups of rows: 4, then 2
                                              (5, 9, 1024, Q4kTiles(4, 128), True)])  # 4 rows, then 1: both kernels
def test_q4k_kernel_equals_its_formula_in_float64(m, n, k, tiles, bias):
    _run(q4k_rows_into, "Q4_K", _q4k_formula, m, n, k, tiles, bias)


@pytest.mark.parametrize("m,n,k,tiles,bias", [(1, 13, 768, Q6kTiles(4, 32), True),  # N ragged, K not a K step multiple
                                              (1, 13, 768, Q6kTiles(8, 16), False),  # K steps of one super-block
                                              (1, 5, 512, Q6kTiles(8, 32), False),  # more rows of W a program than N
                                              (1, 9, 1024, Q6kTiles(4, 64), True),  # the K step divides K: no masks
                                              (2, 13, 768, Q6kTiles(2, 32), True),  # two accumulators
                                              (5, 9, 1024, Q6kTiles(4, 64), False)])  # two groups of rows: 4, then 1
def test_q6k_kernel_equals_its_formula_in_float64(m, n, k, tiles, bias):
    """Odd super-blocks sit at 2-byte aligned offsets, so N and K here include odd ones."""
    _run(q6k_rows_into, "Q6_K", _q6k_formula, m, n, k, tiles, bias)


@pytest.mark.parametrize("m,n,k,tiles,bias", [(1, 13, 448, Q8Tiles(4, 32), True),  # K not a K step multiple, rows
                                              # of 119 words
                                              (1, 3, 256, Q8Tiles(8, 64), False),  # more rows of W a program than N;
                                              # rows of 4n words (QUADS)
                                              (1, 9, 512, Q8Tiles(4, 64), True),  # the K step divides K: no masks
                                              (3, 13, 448, Q8Tiles(4, 32), False),  # three accumulators
                                              (5, 9, 512, Q8Tiles(2, 128), True),  # two groups of rows: 4, then 1
                                              (1, 6, 1088, None, False),  # the one-row default: 272 words, no
                                              # multiple of its K step
                                              (2, 6, 2112, None, True)])  # the default above one row: 528 words
def test_q80_kernel_equals_its_formula_in_float64(m, n, k, tiles, bias):
    _run(q80_rows_into, "Q8_0", _q80_formula, m, n, k, tiles, bias)


# (type, rows of x, N, K, tiles, bias): the int8 MMA kernels (kernels/gguf_int8_mma.py)
@pytest.mark.parametrize("name,m,n,k,tiles,bias", [
    ("Q4_K", 3, 80, 512, MmaTiles(split_programs=4, min_split_super_blocks=1), True),  # K split in 2, merged
    ("Q4_K", 17, 20, 768, MmaTiles(block_n=16, max_row_tile=16), False),  # 2 row tiles, the second of one row;
    # N ragged; K split 2 + 1 super-blocks (the first split's loop runs twice)
    ("Q6_K", 5, 80, 768, MmaTiles(split_programs=8, min_split_super_blocks=1), False),  # 3 splits, odd blocks
    ("Q6_K", 17, 13, 512, MmaTiles(block_n=16), True),  # a row tile of 32, unsplit
    ("Q8_0", 9, 70, 512, MmaTiles(split_programs=4, min_split_super_blocks=1), True),
    ("Q8_0", 33, 16, 256, MmaTiles(block_n=16, max_row_tile=32), False)])  # 2 row tiles, the second of one row
def test_mma_kernels_equal_their_formula_in_float64(name, m, n, k, tiles, bias):
    formula = {"Q4_K": _q4k_formula, "Q6_K": _q6k_formula, "Q8_0": _q80_formula}[name]
    _run(lambda *a, tiles, **kw: mma_rows_into(*a[:2], BY_NAME[name], *a[2:], tiles=tiles, **kw), name, formula, m,
         n, k, tiles, bias)


def test_int8_activations_cost_about_a_percent_against_dequantize_then_matmul():
    """The one approximation: x rounded to int8 per 32-block. On random Q4_K rows (codes uniform, offsets
    centring the weights) that is about 0.5% of the output's norm; with the codes not centred on 8 in the
    product term (sum q * xq) the same rows were off by 0.8-0.9%."""
    n, k = 64, 4096
    blocks = random_blocks("Q4_K", n, k, np.random.default_rng(1))
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    out = torch.empty(1, n, device=DEV)
    q4k_rows_into(x.to(DEV), torch.from_numpy(blocks).to(DEV), None, out, tiles=Q4kTiles(8, 256))
    exact = gguf_quants.dequantize(blocks, Q4_K).astype(np.float64) @ x[0].double().numpy()
    err = np.linalg.norm(out[0].double().cpu().numpy() - exact) / np.linalg.norm(exact)
    assert err < 7e-3, err


def test_gguf_linear_takes_them_for_half_precision_rows_where_the_tables_say(monkeypatch):
    """INT8_DOT_ROWS, INT8_MMA_ROWS and HALF_MMA_ROWS: Q4_K, Q6_K and Q8_0 take the dp4a kernels at 1-4 rows, the
    int8 MMA kernels at 5-16, the half-precision ones at 17-64, never float32 rows, none above 64; INT8_DOT_K:
    Q8_0 rows of an odd number of blocks are not whole words, and are never taken; the MMA kernels take whole
    super-blocks only, and leave other K to the dp4a kernels."""
    from ostinato.kernels import gguf_gemv, gguf_int8_route

    taken = []
    for qtype, name in ((Q4_K, "Q4_K"), (Q6_K, "Q6_K"), (Q8_0, "Q8_0")):
        tiles, _ = gguf_int8_route.INT8_DOT_KERNELS[qtype]
        monkeypatch.setitem(gguf_int8_route.INT8_DOT_KERNELS, qtype,
                            (tiles, lambda *a, name=name, **kw: taken.append(("dot", name, a[0].shape[0]))))
    monkeypatch.setattr(gguf_int8_route, "mma_rows_into", lambda x, blocks, qtype, bias, out, pdl, tiles, *a:
                        taken.append(("half" if tiles and tiles.decode_to_x else "mma", BY_TYPE[qtype], x.shape[0])))
    monkeypatch.setattr(gguf_gemv, "gguf_matmul_dequantized",
                        lambda x, blocks, qtype, *a: taken.append(("dense", BY_TYPE[qtype], x.shape[0])))
    cases = [(1, torch.bfloat16), (1, torch.float16), (1, torch.float32), (2, torch.bfloat16), (4, torch.float16),
             (5, torch.bfloat16), (8, torch.float16), (8, torch.float32), (16, torch.bfloat16), (17, torch.bfloat16),
             (64, torch.float16), (32, torch.float32), (65, torch.bfloat16)]
    for name, qtype in [("Q4_K", Q4_K), ("Q6_K", Q6_K), ("Q8_0", Q8_0)]:
        blocks = device_rows(torch.from_numpy(random_blocks(name, 4, 512, np.random.default_rng(0))), qtype).to(DEV)
        for m, dtype in cases:
            gguf_gemv.gguf_linear_into(torch.randn(m, 512, device=DEV).to(dtype), blocks, qtype, None,
                                       torch.empty(m, 4, device=DEV, dtype=dtype))
    expected = [(kernel, name, m) for name in ("Q4_K", "Q6_K", "Q8_0")
                for kernel, m in (("dot", 1), ("dot", 1), ("dot", 2), ("dot", 4), ("mma", 5), ("mma", 8), ("mma", 16),
                                  ("half", 17), ("half", 64), ("dense", 32), ("dense", 65))]
    for m, k in ((2, 96), (6, 320)):  # 3 blocks: no whole words; 10 blocks: no whole super-blocks
        blocks = device_rows(torch.from_numpy(random_blocks("Q8_0", 4, k, np.random.default_rng(0))), Q8_0).to(DEV)
        gguf_gemv.gguf_linear_into(torch.randn(m, k, device=DEV).to(torch.bfloat16), blocks, Q8_0, None,
                                   torch.empty(m, 4, device=DEV, dtype=torch.bfloat16))
    assert taken == expected + [("dot", "Q8_0", 6)]


def test_a_concat_quantizes_x_once_for_its_integer_dot_parts(monkeypatch):
    """GGUFConcat's Q4_K, Q8_0 and Q6_K shards at one bf16 row (and a Q4_0 one, which takes none): one quantizing
    launch, and each shard's columns as its own call makes them."""
    from ostinato.kernels import gguf_gemv, gguf_int8_dot, gguf_int8_q6k_q80

    k = 512
    parts = [(device_rows(torch.from_numpy(random_blocks(name, n, k, np.random.default_rng(n))), qtype).to(DEV),
              qtype, None)
             for name, qtype, n in (("Q4_K", Q4_K, 7), ("Q8_0", Q8_0, 3), ("Q4_0", Q4_0, 4), ("Q6_K", Q6_K, 5))]
    x = _x(1, k, 3).to(DEV)
    alone = torch.cat([_one_call(x, blocks, qtype) for blocks, qtype, _ in parts], dim=1)
    calls = []
    for module in (gguf_gemv, gguf_int8_dot, gguf_int8_q6k_q80):  # wherever a kernel's wrapper would quantize x
        monkeypatch.setattr(module, "quantize_x", lambda *a: calls.append(a) or quantize_x(*a))
    out = torch.full((1, 19), -1.0, device=DEV, dtype=torch.bfloat16)
    gguf_gemv.gguf_concat_into(x, parts, out)
    assert len(calls) == 1
    torch.testing.assert_close(out, alone, rtol=0, atol=0)


@pytest.mark.parametrize("k", [512, 4096])  # K steps that do not divide K, and that do
def test_q4k_then_q6k_shards_take_one_launch_with_each_shard_s_values(monkeypatch, k):
    """GGUFConcat's Q4_K then Q6_K shards at one bf16 row (Q4_K_M's q|k and v), a bias on each and N ragged: one
    launch, no per-type kernel, and each shard's columns bit for bit as its own call makes them."""
    from ostinato.kernels import gguf_gemv, gguf_int8_route

    parts = [(device_rows(torch.from_numpy(random_blocks(name, n, k, np.random.default_rng(n))), qtype).to(DEV),
              qtype, torch.randn(n, generator=torch.Generator().manual_seed(n)).to(DEV, torch.bfloat16))
             for name, qtype, n in (("Q4_K", Q4_K, 9), ("Q6_K", Q6_K, 6))]
    x = _x(1, k, 7).to(DEV)
    alone = torch.empty(1, 15, device=DEV, dtype=torch.bfloat16)
    gguf_gemv.gguf_linear_into(x, parts[0][0], Q4_K, parts[0][2], alone[:, :9])
    gguf_gemv.gguf_linear_into(x, parts[1][0], Q6_K, parts[1][2], alone[:, 9:])
    calls = []
    for qtype in (Q4_K, Q6_K):
        monkeypatch.setitem(gguf_int8_route.INT8_DOT_KERNELS, qtype, (None, lambda *a: calls.append("per type")))
    mixed = gguf_gemv.q4k_then_q6k_into
    monkeypatch.setattr(gguf_gemv, "q4k_then_q6k_into", lambda *a: calls.append("mixed") or mixed(*a))
    out = torch.full((1, 15), -1.0, device=DEV, dtype=torch.bfloat16)
    gguf_gemv.gguf_concat_into(x, [(blocks, qtype, bias) for blocks, qtype, bias in parts], out)
    assert calls == ["mixed"]
    torch.testing.assert_close(out, alone, rtol=0, atol=0)


def _one_call(x, blocks, qtype):
    from ostinato.kernels import gguf_gemv

    out = torch.empty(1, blocks.shape[0], device=DEV, dtype=x.dtype)
    gguf_gemv.gguf_linear_into(x, blocks, qtype, None, out)
    return out


def test_x_quantized_ahead_is_what_the_kernel_multiplies():
    """Given qx, the kernel reads x only through it: another row's quantization gives that row's product."""
    k, n = 512, 6
    blocks = torch.from_numpy(random_blocks("Q4_K", n, k, np.random.default_rng(2))).to(DEV)
    x, other = _x(1, k, 4).to(DEV), _x(1, k, 5).to(DEV)
    got, want = torch.empty(1, n, device=DEV), torch.empty(1, n, device=DEV)
    q4k_rows_into(x, blocks, None, got, qx=quantize_x(other))
    q4k_rows_into(other, blocks, None, want)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("name,m,n,k,tiles", [
    ("Q4_K", 3, 80, 512, MmaTiles(split_programs=4, min_split_super_blocks=1, decode_to_x=True)),
    ("Q6_K", 20, 13, 768, MmaTiles(block_n=16, decode_to_x=True)),
    ("Q8_0", 40, 16, 256, MmaTiles(block_n=16, max_row_tile=32, decode_to_x=True))])
def test_mma_kernels_decoding_to_half_precision_equal_dequantize_then_matmul(name, m, n, k, tiles):
    """W decoded to x's dtype in registers and multiplied unquantized (fp16 here: the interpreter's bf16 tl.dot is
    wrong): off by the 16-bit rounding of W and of the output only."""
    blocks = random_blocks(name, n, k, np.random.default_rng(n + k + m))
    x = _x(m, k, n + m).to(torch.float16)
    out = torch.empty(m, n, device=DEV, dtype=torch.float16)
    mma_rows_into(x.to(DEV), device_rows(torch.from_numpy(blocks), BY_NAME[name]).to(DEV), BY_NAME[name], None, out,
                  tiles=tiles)
    want = x.double().numpy() @ gguf_quants.dequantize(blocks, BY_NAME[name]).astype(np.float64).T
    err = np.linalg.norm(out.double().cpu().numpy() - want) / np.linalg.norm(want)
    assert err < 1e-3, err


@pytest.mark.parametrize("name", ["Q6_K", "Q8_0"])
@pytest.mark.parametrize("m", [1, 8, 24, 70])  # dp4a, int8 MMA, W decoded in MMAs, dense slices
def test_float32_out_from_half_precision_rows_on_every_path(name, m):
    """What a quantized lm_head asks (model/layers.QuantizedLMHead): float32 out from 16-bit rows, on each path
    the rows take (fp16 here: the interpreter's bf16 tl.dot is wrong): every element written, within the path's
    error of the float64 reference, and not rounded to 16 bits on the way."""
    from ostinato.kernels.gguf_gemv import gguf_linear_into

    n, k = 24, 512
    blocks = random_blocks(name, n, k, np.random.default_rng(m))
    x = _x(m, k, m).to(torch.float16)
    out = torch.full((m, n), float("nan"), device=DEV, dtype=torch.float32)
    gguf_linear_into(x.to(DEV), device_rows(torch.from_numpy(blocks), BY_NAME[name]).to(DEV), BY_NAME[name], None, out)
    want = x.double().numpy() @ gguf_quants.dequantize(blocks, BY_NAME[name]).astype(np.float64).T
    err = np.linalg.norm(out.double().cpu().numpy() - want) / np.linalg.norm(want)
    assert err < (1e-2 if m <= 16 else 1e-3), err  # x rounded to int8 per 32 values up to 16 rows
    assert not torch.equal(out, out.half().float())  # float32 sums, not 16-bit results widened
