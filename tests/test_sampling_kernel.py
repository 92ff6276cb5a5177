"""The Triton draw of sample_tokens (runner/sampling_kernel.py) against the torch inverse CDF it replaces.

On CPU the kernel runs under TRITON_INTERPRET=1 (conftest sets it), with small tiles so that a row spans
several of them; on the GPU at a real vocabulary, inside the path sample_tokens takes.
"""

from __future__ import annotations

import pytest
import torch

from ostinato.runner import sampler
from ostinato.runner.sampler import GREEDY_TEMPERATURE, sample_tokens, uniform

triton = pytest.importorskip("triton")
from ostinato.runner import sampling_kernel  # noqa: E402


def _torch_draw(logits, temperature, u):
    """The torch path of sample_tokens for the sampled rows (runner/sampler._inverse_cdf)."""
    probs = logits.float() / torch.where(temperature < GREEDY_TEMPERATURE, 1.0, temperature)[:, None]
    probs = (probs - probs.amax(dim=-1, keepdim=True)).exp()
    return sampler._inverse_cdf(probs, u)


def _near_boundary(logits, temperature, u, rel=2e-6):
    """Rows whose u * total lies within float rounding of a cumulative-sum boundary (either pick is right)."""
    x = logits.double() / torch.where(temperature < GREEDY_TEMPERATURE, 1.0, temperature).double()[:, None]
    cdf = (x - x.amax(dim=-1, keepdim=True)).exp().cumsum(-1)
    target = u.double()[:, None] * cdf[:, -1:]
    return ((cdf - target).abs() <= rel * cdf[:, -1:]).any(dim=-1)


@pytest.mark.parametrize("vocab,block", [(1000, 128), (257, 64), (64, 64)])
def test_kernel_draws_what_the_torch_inverse_cdf_draws(vocab, block):
    g = torch.Generator().manual_seed(vocab)
    rows = 24
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[0, 5] = 40.0  # one row almost one-hot
    temperature = torch.rand(rows, generator=g) * 1.5 + 0.1
    temperature[1] = 0.0  # a greedy row: divides by 1, as the torch path does
    u = uniform(torch.arange(rows, dtype=torch.int64) * 7919, torch.full((rows,), 3, dtype=torch.int64))
    got = sampling_kernel.draw(logits, temperature, u, GREEDY_TEMPERATURE, block=block)
    want = _torch_draw(logits, temperature, u)
    ambiguous = _near_boundary(logits, temperature, u)
    assert ambiguous.sum() <= 2  # the comparison below must cover the rows
    assert torch.equal(got[~ambiguous], want[~ambiguous])
    assert got[0] == 5


def test_kernel_reads_temperature_from_the_decode_rows_strided_column():
    # The decode step hands the draw DecodeLayout.sampling_inputs' temperature: a column of the packed [B, width]
    # int32 rows viewed as float32, so consecutive rows are `width` elements apart. Read as if contiguous, row r
    # would take its temperature from other fields of row 0 (block-table entries as floats).
    from ostinato.runner.decode_batch import DecodeLayout

    g = torch.Generator().manual_seed(11)
    rows, vocab, width = 6, 300, 40
    packed = torch.randint(0, 1 << 20, (rows, width), generator=g, dtype=torch.int32)
    wanted_t = torch.tensor([0.0, 0.3, 1.7, 0.05, 1.0, 2.5])
    from ostinato.runner.decode_batch import TEMP

    packed[:, TEMP] = wanted_t.view(torch.int32)
    temperature = DecodeLayout.sampling_inputs(packed)["temperature"]
    assert temperature.stride(0) == width and torch.equal(temperature, wanted_t)
    logits = torch.randn(rows, vocab, generator=g) * 4
    u = uniform(torch.arange(rows, dtype=torch.int64) * 31, torch.zeros(rows, dtype=torch.int64))
    got = sampling_kernel.draw(logits, temperature, u, GREEDY_TEMPERATURE, block=64)
    want = _torch_draw(logits, wanted_t, u)
    ambiguous = _near_boundary(logits, wanted_t, u)
    assert not ambiguous.any()
    assert torch.equal(got, want)


def test_decode_rows_draw_the_same_tokens_through_the_kernel_and_the_torch_path(monkeypatch):
    # DecodeStep.sample's inputs as the decode graph has them (strided settings from the packed rows), through
    # sample_tokens: with the kernel (forced on here; on a GPU from MIN_ROWS rows) and without it.
    from ostinato.runner.decode_batch import CTR, KEY_HI, KEY_LO, TEMP, DecodeLayout

    g = torch.Generator().manual_seed(5)
    rows, vocab = 8, 200
    packed = torch.zeros(rows, 30, dtype=torch.int32)
    packed[:, TEMP] = torch.tensor([0.0, 0.7, 1.3, 0.2, 1.0, 0.0, 2.0, 0.9]).view(torch.int32)
    packed[:, KEY_LO] = torch.randint(0, 1 << 30, (rows,), generator=g, dtype=torch.int32)
    packed[:, KEY_HI] = torch.randint(0, 1 << 30, (rows,), generator=g, dtype=torch.int32)
    packed[:, CTR] = torch.arange(rows, dtype=torch.int32)
    settings = DecodeLayout.sampling_inputs(packed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    torch_path = sample_tokens(logits, settings["temperature"], settings["key"], settings["counter"])
    monkeypatch.setattr(sampling_kernel, "available_for", lambda logits: True)
    kernel_path = sample_tokens(logits, settings["temperature"], settings["key"], settings["counter"])
    u = uniform(settings["key"], settings["counter"])
    ambiguous = _near_boundary(logits, settings["temperature"], u)
    assert not ambiguous.any()
    assert torch.equal(kernel_path, torch_path)


def test_kernel_skips_zero_probability_tokens_and_clamps_u_near_one():
    vocab = 300
    logits = torch.full((3, vocab), -1e4)
    logits[:, 10] = 0.0
    logits[:, 200] = 0.0  # two tokens of mass 1/2 each, every other token's mass underflows to 0
    u = torch.tensor([0.25, 0.75, 0.999999])
    got = sampling_kernel.draw(logits, torch.ones(3), u, GREEDY_TEMPERATURE, block=64)
    assert got.tolist() == [10, 200, 200]


def test_sample_tokens_uses_the_kernel_only_where_it_runs(monkeypatch):
    """CPU tensors keep the torch path (the reference); the dispatch rule is available_for()."""
    logits = torch.randn(4, 50)
    assert not sampling_kernel.available_for(logits)
    assert not sampling_kernel.available_for(torch.randn(sampling_kernel.MIN_ROWS, 50))  # CPU
    calls = []
    monkeypatch.setattr(sampling_kernel, "available_for", lambda _l: True)
    monkeypatch.setattr(sampling_kernel, "draw", lambda *a, **k: calls.append(a) or torch.zeros(4, dtype=torch.int64))
    temperature = torch.tensor([0.0, 1.0, 1.0, 0.0])
    out = sample_tokens(logits, temperature, torch.arange(4), torch.zeros(4, dtype=torch.int64))
    assert len(calls) == 1
    assert out[0] == logits[0].argmax() and out[3] == logits[3].argmax()  # greedy rows: the argmax
    assert out[1] == 0 and out[2] == 0  # sampled rows: the kernel's draw


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_matches_torch_on_the_gpu_at_a_real_vocabulary():
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, vocab = 64, 151_936
    logits = torch.randn(rows, vocab, device="cuda", generator=g) * 4
    temperature = torch.rand(rows, device="cuda", generator=g) + 0.2
    u = uniform(torch.arange(rows, device="cuda") * 31, torch.zeros(rows, dtype=torch.int64, device="cuda"))
    got = sampling_kernel.draw(logits, temperature, u, GREEDY_TEMPERATURE)
    want = _torch_draw(logits, temperature, u)
    ambiguous = _near_boundary(logits, temperature, u)
    assert ambiguous.sum() <= 8  # 152k boundaries per row: a few rows land within rounding of one
    assert torch.equal(got[~ambiguous], want[~ambiguous])
    rows_small = sampling_kernel.MIN_ROWS - 1
    assert not sampling_kernel.available_for(logits[:rows_small]) and sampling_kernel.available_for(logits)
