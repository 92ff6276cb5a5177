"""--kv-cache-dtype through the offline engine (CPU, the torch attention backend, a tiny float32 Llama): fp8 makes
the pool E4M3, a quarter of float32's bytes a block (half of bf16's on a GPU), and greedy output stays logprob-close
to the model-dtype cache's (equal up to the first difference; there each side's token in the other's top 5). The
kernels' FP8 reads and writes are checked in tests/kernels/test_fp8_kv_cache.py."""

from __future__ import annotations

import pytest
import torch

from ostinato import SamplingParams
from ostinato.config import EngineArgs
from ostinato.errors import ConfigError
from support.near_tie import identical_or_near_tie
from support.tiny_llm import tiny_llm

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
PROMPTS = [[1, 5, 9, 13, 2], [7, 7, 7, 7], list(range(3, 40)), [100, 4, 250, 61, 8, 19]]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    settings = dict(num_kv_blocks=64, max_model_len=128, max_num_seqs=4)
    return (tiny_llm(tmp_path_factory, "kv-auto", **settings),
            tiny_llm(tmp_path_factory, "kv-fp8", kv_cache_dtype="fp8", **settings))


def test_fp8_makes_the_pool_e4m3_at_a_quarter_of_float32_s_bytes(engines):
    model_dtype, fp8 = (llm.engine.runner.kv_caches for llm in engines)
    assert model_dtype[0][0].dtype == torch.float32 and fp8[0][0].dtype == torch.float8_e4m3fn
    assert all(k.shape == k8.shape for (k, _), (k8, _) in zip(model_dtype, fp8))
    assert fp8[0][0].nbytes * 4 == model_dtype[0][0].nbytes


def test_fp8_greedy_is_logprob_close_to_the_model_dtype_cache(engines):
    auto, fp8 = ([o.outputs[0] for o in llm.generate(PROMPTS, GREEDY)] for llm in engines)
    identical = sum(identical_or_near_tie(a, b) for a, b in zip(auto, fp8))
    assert identical >= 1  # FP8's rounding moves a near-tie at most, not every sequence


def test_an_unknown_kv_cache_dtype_names_the_choices():
    with pytest.raises(ConfigError, match="--kv-cache-dtype must be one of auto, fp8, fp8_e4m3, got 'int8'"):
        EngineArgs(model="m", kv_cache_dtype="int8")
    assert EngineArgs(model="m", kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
