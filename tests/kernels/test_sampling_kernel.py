"""The sampling kernels (kernels/sampling.py) against the torch path of sample_tokens they replace on a GPU.

On CPU the kernels run under TRITON_INTERPRET=1 (conftest sets it), with small tiles and chunks so that a row
spans several chunks and a chunk several tiles; on the GPU at a real vocabulary and through the decode step.
"""

from __future__ import annotations

import pytest
import torch

from ostinato.runner import sampler
from ostinato.runner.decode_batch import BLOCKS, CTR, KEY_HI, KEY_LO, ROW_COLUMNS, TEMP
from ostinato.runner.sampler import GREEDY_TEMPERATURE, uniform
from ostinato.runner.sampling_state import sampling_inputs

triton = pytest.importorskip("triton")
from ostinato.kernels import sampling as sampling_kernel  # noqa: E402


def _torch_path(logits, temperature, key, counter):
    """sample_tokens' torch path (the reference), whatever device the tensors are on."""
    real = sampling_kernel.available_for
    sampling_kernel.available_for = lambda _logits: False
    try:
        return sampler.sample_tokens(logits, temperature, key, counter)
    finally:
        sampling_kernel.available_for = real


def _rows(temperature, key, counter):
    """[B] settings -> [B, BLOCKS] int32 rows holding them at ROW_COLUMNS, as a sequence's decode row does."""
    rows = torch.zeros(len(temperature), BLOCKS, dtype=torch.int32, device=temperature.device)
    rows[:, TEMP] = temperature.to(torch.float32).view(torch.int32)
    rows[:, KEY_LO] = (key & 0xFFFFFFFF).to(torch.int32)
    rows[:, KEY_HI] = (key >> 32).to(torch.int32)
    rows[:, CTR] = counter.to(torch.int32)
    return rows


def _sample_rows(logits, rows):
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    sampler.sample_rows(logits, rows, out)
    return out


def _near_boundary(logits, temperature, u, rel=2e-6):
    """Rows whose u * total lies within float rounding of a cumulative-sum boundary (either pick is right)."""
    x = logits.double() / torch.where(temperature < GREEDY_TEMPERATURE, 1.0, temperature).double()[:, None]
    cdf = (x - x.amax(dim=-1, keepdim=True)).exp().cumsum(-1)
    target = u.double()[:, None] * cdf[:, -1:]
    return ((cdf - target).abs() <= rel * cdf[:, -1:]).any(dim=-1)


def _kernel(logits, rows, columns, num_sms=4, block=64, chunk_max=256):
    out = torch.full((logits.shape[0],), -1, dtype=torch.int64, device=logits.device)
    sampling_kernel.sample(logits, rows, columns, out, GREEDY_TEMPERATURE, num_sms, block=block, chunk_max=chunk_max)
    return out


def _settings(rows, g):
    temperature = torch.rand(rows, generator=g) * 1.5 + 0.1
    temperature[1] = 0.0  # greedy rows
    temperature[rows - 1] = 0.0
    key = torch.randint(-(1 << 62), 1 << 62, (rows,), generator=g, dtype=torch.int64)
    key[2] = -1  # all 64 bits set: the halves' sign and zero extension matter
    counter = torch.randint(0, 5000, (rows,), generator=g, dtype=torch.int64)
    return temperature, key, counter


@pytest.mark.parametrize("vocab,block,chunk_max,num_sms", [(1000, 64, 256, 4), (1000, 64, 128, 64), (257, 64, 64, 4),
                                                           (64, 64, 64, 4), (3000, 128, 1024, 1)])
def test_kernels_draw_what_the_torch_path_draws(vocab, block, chunk_max, num_sms):
    g = torch.Generator().manual_seed(vocab + num_sms)
    rows = 24
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[0, 5] = 40.0  # one row almost one-hot
    logits[3, :] = 0.5  # a row of ties: greedy or not, the tie rules must agree
    temperature, key, counter = _settings(rows, g)
    temperature[3] = 0.0
    plan = sampling_kernel.plan_chunks(rows, vocab, num_sms, block, chunk_max)
    assert plan.chunk <= max(chunk_max, plan.block)
    got = _kernel(logits, _rows(temperature, key, counter), ROW_COLUMNS, num_sms, block, chunk_max)
    want = _torch_path(logits, temperature, key, counter)
    ambiguous = _near_boundary(logits, temperature, uniform(key, counter)) & (temperature >= GREEDY_TEMPERATURE)
    assert ambiguous.sum() <= 2  # the comparison below must cover the rows
    assert torch.equal(got[~ambiguous], want[~ambiguous])
    assert got[0] == 5 and got[3] == 0


def test_greedy_rows_take_the_first_index_of_a_max_split_across_chunks():
    vocab = 600
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(2))
    logits[0, [70, 130, 590]] = 9.0  # ties in different chunks and tiles: the first wins
    logits[1, [64, 65]] = 9.0  # a tie inside one tile
    logits[2, 599] = 9.0  # the last entry
    logits[3, 0] = 9.0
    zeros = torch.zeros(4, dtype=torch.int64)
    got = _kernel(logits, _rows(torch.zeros(4), zeros, zeros), ROW_COLUMNS, block=64, chunk_max=128)
    assert got.tolist() == [70, 64, 599, 0] == logits.argmax(-1).tolist()


def test_the_device_hash_is_sampler_uniform():
    # The pick kernel hashes key and counter itself: a draw whose u sits between two chunks' cumulative masses
    # only lands right if its u equals uniform()'s. Here every token has the same mass, so the drawn index is
    # floor(u * vocab) (away from boundaries) and exposes u directly.
    g = torch.Generator().manual_seed(9)
    rows, vocab = 64, 4096
    key = torch.randint(-(1 << 63), (1 << 63) - 1, (rows,), generator=g, dtype=torch.int64)
    counter = torch.randint(0, 1 << 30, (rows,), generator=g, dtype=torch.int64)
    u = uniform(key, counter)
    got = _kernel(torch.zeros(rows, vocab), _rows(torch.ones(rows), key, counter), ROW_COLUMNS,
                  block=256, chunk_max=1024)
    exact = (u * vocab).floor()
    clear = ((u * vocab) - exact).abs() > 1e-3
    assert clear.sum() > rows // 2
    assert torch.equal(got[clear], exact[clear].long())


def test_decode_rows_are_read_in_place():
    # DecodeStep.sample passes the packed decode rows (settings at ROW_COLUMNS, `width` apart): the same tokens as
    # the torch path on sampling_inputs of those rows.
    g = torch.Generator().manual_seed(5)
    rows, vocab, width = 8, 200, 30
    packed = torch.randint(0, 1 << 20, (rows, width), generator=g, dtype=torch.int32)  # other fields: noise
    packed[:, TEMP] = torch.tensor([0.0, 0.7, 1.3, 0.2, 1.0, 0.0, 2.0, 0.9]).view(torch.int32)
    packed[:, KEY_LO] = torch.randint(-(1 << 31), (1 << 31) - 1, (rows,), generator=g, dtype=torch.int32)
    packed[:, KEY_HI] = torch.randint(-(1 << 31), (1 << 31) - 1, (rows,), generator=g, dtype=torch.int32)
    packed[:, CTR] = torch.arange(rows, dtype=torch.int32)
    s = sampling_inputs(packed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    want = _torch_path(logits, s["temperature"], s["key"], s["counter"])
    got = _kernel(logits, packed, ROW_COLUMNS)
    assert not _near_boundary(logits, s["temperature"], uniform(s["key"], s["counter"])).any()
    assert torch.equal(got, want)
    # A step of fewer rows than the rows tensor holds (a graph of 8 running 5) reads the first ones only.
    assert torch.equal(_kernel(logits[:5], packed, ROW_COLUMNS), want[:5])


def test_kernels_skip_zero_probability_tokens():
    # Two tokens of mass 1/2 each; every other token's mass underflows to 0, and no draw may land on one. u comes
    # from the hash, so over 64 keys both tokens are drawn, and each row agrees with the torch path's draw.
    vocab, rows = 300, 64
    logits = torch.full((rows, vocab), -1e4)
    logits[:, 10] = 0.0
    logits[:, 200] = 0.0
    key = torch.arange(rows, dtype=torch.int64) * 7919
    counter = torch.zeros(rows, dtype=torch.int64)
    got = _kernel(logits, _rows(torch.ones(rows), key, counter), ROW_COLUMNS)
    assert set(got.tolist()) == {10, 200}
    assert torch.equal(got, _torch_path(logits, torch.ones(rows), key, counter))


def test_plan_fills_the_gpu_and_bounds_the_walk():
    p = sampling_kernel.plan_chunks(1, 151_936, 132)
    assert p.chunk == 1024 and p.num_chunks == 149
    p = sampling_kernel.plan_chunks(16, 151_936, 132)
    assert p.num_chunks * 16 >= 4 * 132 and p.chunk % p.block == 0
    p = sampling_kernel.plan_chunks(256, 151_936, 132)
    assert p.chunk == sampling_kernel.CHUNK_MAX and p.num_chunks == 19
    p = sampling_kernel.plan_chunks(3, 50, 132)
    assert p.block == 64 and p.num_chunks == 1


def test_sample_rows_takes_the_kernels_where_they_run(monkeypatch):
    """CPU tensors keep the torch path (the reference); with the kernels forced on, the same tokens."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 300, generator=g) * 2
    temperature, key, counter = _settings(6, g)
    assert not sampling_kernel.available_for(logits)
    want = _sample_rows(logits, _rows(temperature, key, counter))
    assert torch.equal(want, sampler.sample_tokens(logits, temperature, key, counter))
    monkeypatch.setattr(sampling_kernel, "available_for", lambda _l: True)
    got = _sample_rows(logits, _rows(temperature, key, counter))
    assert not _near_boundary(logits, temperature, uniform(key, counter)).any()
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 3, 16, 64, 256])
def test_kernels_match_torch_on_the_gpu_at_a_real_vocabulary(rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    vocab = 151_936
    logits = torch.randn(rows, vocab, device="cuda", generator=g) * 4
    temperature = torch.rand(rows, device="cuda", generator=g) + 0.2
    temperature[::3] = 0.0
    key = torch.arange(rows, device="cuda", dtype=torch.int64) * 0x9E3779B97F4A7C1 - 12345
    counter = torch.arange(rows, device="cuda", dtype=torch.int64) * 3
    got = _sample_rows(logits, _rows(temperature, key, counter))
    want = _torch_path(logits, temperature, key, counter)
    ambiguous = _near_boundary(logits, temperature, uniform(key, counter)) & (temperature >= GREEDY_TEMPERATURE)
    assert ambiguous.sum() <= max(2, rows // 16)  # 152k boundaries per row: a few land within rounding of one
    assert torch.equal(got[~ambiguous], want[~ambiguous])
    assert torch.equal(got[temperature == 0], logits[temperature == 0].argmax(-1))
