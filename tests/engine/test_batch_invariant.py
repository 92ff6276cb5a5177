"""--batch-invariant on CPU (the torch path, fp32 and bf16): a request run alone gives bit for bit the tokens and the
logprobs (the sampled token's and the top 20, every step) it gives in a batch of prompts of mixed lengths, with
chunk budgets of 16 and 2048 tokens, with a cached prefix and without, greedy and seeded sampling.

The default mode is checked against the same requests too: where it is not invariant on this machine (torch's
fp32 F.linear picks its kernel by row count), that is what the mode exists for; the test only asserts the mode.
"""

from __future__ import annotations

import pytest
import torch

from ostinato import LLM, SamplingParams
from ostinato.errors import ConfigError
from ostinato.config import EngineArgs
from ostinato.tools.checkpoint import make_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=20)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("invariant-qwen3")
    make_checkpoint(path, shape="tiny", family="qwen3", seed=5)
    return path


def _prompts(vocab: int) -> list[list[int]]:
    """Mixed lengths; the last shares a 32-token prefix (two blocks of 16) with the first."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, vocab, (200,), generator=gen).tolist()
    return [ids[:40], ids[50:53], ids[60:79], ids[:32] + ids[100:105]]


def _llm(path, dtype: str, **kwargs) -> LLM:
    return LLM(str(path), device="cpu", dtype=dtype, max_model_len=128, block_size=16, num_kv_blocks=64,
               batch_invariant=True, **kwargs)


def _trace(output) -> list[tuple]:
    """Every step's token, its logprob and the top 20 (ids and logprobs): the logits' top as exact floats."""
    c = output.outputs[0]
    return [(lp.token_id, lp.logprob, tuple(lp.top)) for lp in c.logprobs]


def _params(seeded: bool, i: int) -> SamplingParams:
    if not seeded:
        return GREEDY
    return SamplingParams(temperature=0.9, max_tokens=4, ignore_eos=True, logprobs=20, seed=1000 + i)


# (budget, runs, seeded): a second run finds the prompts' full blocks cached (a cached prefix for every row).
RUNS = [(16, 2, False), (2048, 1, False), (16, 1, True), (2048, 2, True)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_alone_equals_batched_bitwise(checkpoint, dtype):
    solo_llm = _llm(checkpoint, dtype, enable_prefix_caching=False)
    prompts = _prompts(solo_llm.engine.model_config.vocab_size)
    alone = {}
    for seeded in (False, True):
        params = [_params(seeded, i) for i in range(len(prompts))]
        alone[seeded] = [_trace(solo_llm.generate([p], sp)[0]) for p, sp in zip(prompts, params)]
    for budget, runs, seeded in RUNS:
        llm = _llm(checkpoint, dtype, max_num_batched_tokens=budget, max_num_seqs=8)
        params = [_params(seeded, i) for i in range(len(prompts))]
        for run in range(runs):
            outs = llm.generate(prompts, params)
            assert [_trace(o) for o in outs] == alone[seeded], (dtype, seeded, budget, run)
        if runs > 1:
            assert sum(o.num_cached_tokens for o in outs) > 0  # the second run did read cached prefixes


def test_staggered_arrivals_match_alone(checkpoint):
    """Requests joining a running batch one step apart (every step a different batch, mixed steps included)."""
    llm = _llm(checkpoint, "float32", max_num_batched_tokens=16, max_num_seqs=8)
    prompts = _prompts(llm.engine.model_config.vocab_size)
    alone = [_trace(llm.generate([p], GREEDY)[0]) for p in prompts]
    engine = llm.engine
    outs: dict[str, object] = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        if pending:
            i, p = pending.pop(0)
            engine.add_request(str(i), p, GREEDY)
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert [_trace(outs[str(i)]) for i in range(len(prompts))] == alone


def test_mode_is_in_the_config_and_stats(checkpoint):
    llm = _llm(checkpoint, "float32")
    assert llm.engine.config.runner.batch_invariant is True
    assert llm.engine.stats().batch_invariant is True
    assert llm.engine.runner.model.kernels.name == "torch+invariant"
    # The draws too: the sampling kernels' chunks planned as for one row (kernels/sampling.py).
    assert llm.engine.runner.sampler.batch_invariant and llm.engine.runner.decode_step.batch_invariant
    default = LLM(str(checkpoint), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16)
    assert default.engine.stats().batch_invariant is False
    assert not default.engine.runner.sampler.batch_invariant and not default.engine.runner.decode_step.batch_invariant


def test_refused_with_tensor_parallelism():
    with pytest.raises(ConfigError, match="--batch-invariant needs --tensor-parallel-size 1"):
        EngineArgs(model="x", batch_invariant=True, tensor_parallel_size=2)
    EngineArgs(model="x", batch_invariant=True, pdl="on")  # PDL changes launch timing only (kernels/fused.py)


def test_cli_flag_reaches_the_engine_args():
    import argparse

    from ostinato.cli_args import add_engine_args, engine_args_from

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_args_from(p.parse_args(["m", "--batch-invariant"])).batch_invariant is True
    assert engine_args_from(p.parse_args(["m"])).batch_invariant is False


def test_torch_backend_on_cuda_needs_eager(checkpoint):
    args = EngineArgs(model=str(checkpoint), batch_invariant=True, attention_backend="torch")
    with pytest.raises(ConfigError, match="--enforce-eager"):
        args.resolve(device="cuda")
    assert EngineArgs(model=str(checkpoint), batch_invariant=True, attention_backend="torch",
                      enforce_eager=True).resolve(device="cuda").runner.batch_invariant


def test_invariant_kernels_with_pdl_differ_only_in_the_launch():
    """--batch-invariant keeps PDL: its kernel set with PDL is the same functions with pdl=True, nothing else."""
    pytest.importorskip("triton")
    from dataclasses import fields

    from ostinato.kernels.decoder_kernels import DecoderKernels
    from ostinato.kernels.fused import INVARIANT_TRITON_KERNELS, INVARIANT_TRITON_KERNELS_PDL, kernels_for

    cuda = torch.device("cuda")
    assert kernels_for(cuda, False, batch_invariant=True) is INVARIANT_TRITON_KERNELS
    assert kernels_for(cuda, True, batch_invariant=True) is INVARIANT_TRITON_KERNELS_PDL
    for f in fields(DecoderKernels):
        plain = getattr(INVARIANT_TRITON_KERNELS, f.name)
        if f.name != "name" and plain is not None:
            fn = getattr(INVARIANT_TRITON_KERNELS_PDL, f.name)
            assert fn.keywords == {"pdl": True} and fn.func is plain, f.name
