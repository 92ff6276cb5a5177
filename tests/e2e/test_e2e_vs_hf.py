"""End to end: LLM.generate greedy tokens equal HF transformers' own model on the same checkpoint (fp32, CPU)."""

import pytest
import torch

from ostinato import LLM, SamplingParams
from ostinato.tools.checkpoint import make_checkpoint

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
PROMPT_LENGTHS = [1, 3, 5, 8, 13, 17, 31, 40]  # 8 prompts, across block boundaries (block size 16)
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"ckpt-{request.param}")
    make_checkpoint(path, shape="tiny", family=request.param, seed=7)
    return path


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _hf_greedy(path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_tokens):
                logits = model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
            outs.append(ids[len(prompt):])
    return outs


def test_greedy_matches_hf(checkpoint):
    llm = LLM(str(checkpoint), device="cpu", dtype="float32", num_kv_blocks=128, max_model_len=128)
    prompts = _prompts(llm.engine.model_config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert ours == _hf_greedy(checkpoint, prompts, MAX_TOKENS)
    assert len({tuple(o) for o in ours}) > 1, "degenerate checkpoint: every prompt gave the same tokens"


def test_greedy_matches_hf_under_preemption(checkpoint):
    # 9 blocks of 16 tokens hold ~144 tokens; 8 sequences growing to up to 52 tokens need far more, so the
    # scheduler must preempt (recompute) and the tokens must still equal HF's.
    llm = LLM(str(checkpoint), device="cpu", dtype="float32", num_kv_blocks=9, max_model_len=64,
              max_num_batched_tokens=64, max_num_seqs=16)
    prompts = _prompts(llm.engine.model_config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.kv_blocks_free == stats.kv_blocks_total  # nothing leaked
    assert ours == _hf_greedy(checkpoint, prompts, MAX_TOKENS)
