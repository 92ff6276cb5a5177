"""The logits processors (runner/logits_processors.py) against HF transformers' own, one row at a time and
mixed in one batch, through the torch path and the Triton kernel (kernels/penalties.py, interpreted on CPU).

Each row's tables are written as a joining sequence's are (LogitsProcessors.join, from its tokens), and the
decode step's counting of the token a row feeds is checked against the same references."""

import numpy as np
import pytest
import torch
from transformers import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper, NoBadWordsLogitsProcessor,
                          RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor, TemperatureLogitsWarper)

from ostinato.contract import LogitsSpec
from ostinato.kernels import penalties as penalties_kernel
from ostinato.kernels.triton_optional import triton
from ostinato.runner.logits_processors import LogitsProcessors, row_flags
from ostinato.runner.sampling_state import BLOCKS, write_settings
from ostinato.sampling_params import SamplingParams

VOCAB = 96
PROMPT = [5, 9, 9, 30, 41]
OUTPUTS = [9, 12, 12, 12, 50, 5, 77]


@pytest.fixture(params=["torch", "triton"])
def path(request, monkeypatch):
    if request.param == "triton":
        if triton is None:
            pytest.skip("triton is not installed")
        monkeypatch.setattr(penalties_kernel, "available_for", lambda logits: True)
    return request.param


def process(specs, logits, histories, num_generated, fed=None):
    """Apply each row's spec (None: no processors) to a copy of logits [B, V], as a prefill draw does (or, with
    `fed`, a decode step feeding those tokens); returns the processed copy."""
    proc = LogitsProcessors(len(specs), VOCAB, torch.device("cpu"))
    rows = np.zeros((len(specs), BLOCKS + 1), dtype=np.int32)
    for row, spec, history, n in zip(rows, specs, histories, num_generated):
        slot = proc.join(spec, history, n) if spec is not None else 0
        params = spec.params if spec is not None else SamplingParams()
        write_settings(row, params, key=0, counter=n + (fed is not None), flags=row_flags(spec), slot=slot)
    out = logits.clone()
    proc.process_logits(out, torch.from_numpy(rows), None if fed is None else torch.tensor(fed))
    return out


def spec(min_tokens_ban=(), bad_words=(), **params):
    return LogitsSpec(SamplingParams(max_tokens=32, **params), tuple(min_tokens_ban), tuple(bad_words))


def logits_of(rows=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * 3


def hf(processor, tokens, logits):
    return processor(torch.tensor([tokens]), logits.clone())


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_is_hf(path, penalty):
    logits = logits_of()
    history = tuple(PROMPT + OUTPUTS)
    out = process([spec(repetition_penalty=penalty)], logits, [history], [len(OUTPUTS)])
    want = hf(RepetitionPenaltyLogitsProcessor(penalty), list(history), logits)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    assert not torch.equal(out, logits)


def openai_penalties(logits, outputs, presence, frequency):
    """OpenAI's definition: logit - count * frequency - (count > 0) * presence, over the generated tokens."""
    counts = torch.bincount(torch.tensor(outputs), minlength=VOCAB).float()
    return logits - counts * frequency - (counts > 0).float() * presence


@pytest.mark.parametrize("presence,frequency", [(0.8, 0.0), (0.0, 0.6), (-0.5, 1.5)])
def test_presence_and_frequency_count_the_output_only(path, presence, frequency):
    logits = logits_of(seed=1)
    out = process([spec(presence_penalty=presence, frequency_penalty=frequency)], logits,
                  [tuple(PROMPT + OUTPUTS)], [len(OUTPUTS)])
    torch.testing.assert_close(out, openai_penalties(logits, OUTPUTS, presence, frequency), rtol=1e-6, atol=1e-6)
    assert torch.equal(out[0, 30], logits[0, 30])  # a prompt token the output never held is left alone


def test_logit_bias_is_hf_sequence_bias(path):
    logits = logits_of(seed=2)
    bias = {3: 100.0, 17: -100.0, 60: 2.5}
    out = process([spec(logit_bias=bias)], logits, [()], [0])
    want = hf(SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()]), PROMPT, logits)
    torch.testing.assert_close(out, want)
    assert out[0].argmax() == 3


def test_min_tokens_bans_the_stop_ids_until_reached_as_hf(path):
    stop = [2, 40]
    logits = logits_of(seed=3)
    for generated in (0, 3, 4, 5):
        outputs = OUTPUTS[:generated]
        out = process([spec(min_tokens=4, min_tokens_ban=stop)], logits, [()], [generated])
        want = hf(MinNewTokensLengthLogitsProcessor(len(PROMPT), 4, stop), PROMPT + outputs, logits)
        assert torch.equal(out, want), generated
        assert torch.isinf(out[0, stop]).all() == (generated < 4)


def test_bad_words_are_hf(path):
    words = [(12, 50), (77,), (5, 77, 3)]
    logits = logits_of(seed=4)
    history = tuple(PROMPT + OUTPUTS)  # the output ends with 5, 77; the 12, 50 pair is further back
    out = process([spec(bad_words=words)], logits, [history], [len(OUTPUTS)])
    want = hf(NoBadWordsLogitsProcessor([list(w) for w in words], eos_token_id=None), list(history), logits)
    assert torch.equal(out, want)
    assert torch.isinf(out[0, [77, 3]]).all() and not torch.isinf(out[0, 50])


@pytest.mark.parametrize("min_p,temperature", [(0.1, 1.0), (0.05, 0.5), (0.3, 2.0)])
def test_min_p_keeps_what_hf_keeps(path, min_p, temperature):
    logits = logits_of(seed=5) / 3  # a flat enough distribution that min_p keeps several tokens
    out = process([spec(min_p=min_p, temperature=temperature)], logits, [()], [0])
    want = MinPLogitsWarper(min_p)(None, TemperatureLogitsWarper(temperature)(None, logits.clone()))
    assert torch.equal(torch.isinf(out), torch.isinf(want))
    assert 1 < int((~torch.isinf(out)).sum()) < VOCAB  # the case masks some tokens and keeps several
    kept = ~torch.isinf(out)
    assert torch.equal(out[kept], logits[kept])


def test_every_processor_in_vllm_order_beside_rows_without_any(path):
    """One batch: rows with no processors keep their logits bit for bit beside a row using all of them, whose
    result is HF's processors applied in vLLM's order (bias and bans, repetition, presence / frequency)."""
    logits = logits_of(rows=3, seed=6)
    history = tuple(PROMPT + OUTPUTS)
    everything = spec(repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.25, logit_bias={8: 4.0},
                      bad_words=[(77, 3)], min_tokens=10, min_tokens_ban=[2])
    out = process([None, everything, None], logits, [(), history, ()], [0, len(OUTPUTS), 0])
    assert torch.equal(out[[0, 2]], logits[[0, 2]])
    want = hf(SequenceBiasLogitsProcessor([[[8], 4.0]]), list(history), logits[1:2])
    want = hf(NoBadWordsLogitsProcessor([[77, 3]], eos_token_id=None), list(history), want)
    want = hf(MinNewTokensLengthLogitsProcessor(len(PROMPT), 10, [2]), list(history), want)
    want = hf(RepetitionPenaltyLogitsProcessor(1.4), list(history), want)
    want = openai_penalties(want, OUTPUTS, 0.5, 0.25)
    torch.testing.assert_close(out[1:2], want, rtol=1e-6, atol=1e-6)


def test_a_decode_step_counts_the_token_each_row_feeds(path):
    """The fed token is the row's newest output: counted (and matched by bad words) before the penalties."""
    logits = logits_of(rows=2, seed=7)
    history = tuple(PROMPT + OUTPUTS)
    specs = [spec(frequency_penalty=1.0, bad_words=[(64, 66)]), None]
    out = process(specs, logits, [history, ()], [len(OUTPUTS), 0], fed=[64, 64])
    want = openai_penalties(logits[:1], OUTPUTS + [64], 0.0, 1.0)
    want[0, 66] = float("-inf")
    torch.testing.assert_close(out[:1], want, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[1], logits[1])
