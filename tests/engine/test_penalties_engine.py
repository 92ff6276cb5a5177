"""Penalties, logit_bias, bad_words and min_tokens through the whole engine: greedy tokens equal HF
transformers' generate with the same settings (fp32, CPU), on the eager decode path and the graph path
(RecordingGraphBackend through the real runner); seeded sampling gives the same tokens on both; and rows that
use no processor give exactly the tokens they gave before, whatever shares their batch."""

import pytest
import torch
import transformers

from support.graph_engine import recorded_graphs
from ostinato import LLM, SamplingParams
from ostinato.engine.logits_spec import bad_word_ids
from ostinato.tools.checkpoint import make_checkpoint

PROMPT = [0, 43, 72, 344, 82, 330, 386]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("penalties") / "ckpt", shape="tiny", family="llama", seed=1)


def make_llm(checkpoint):
    return LLM(str(checkpoint), device="cpu", dtype="float32", num_kv_blocks=48, max_model_len=64, max_num_seqs=4)


@pytest.fixture(scope="module")
def engines(checkpoint):
    eager = make_llm(checkpoint)
    with recorded_graphs((1, 2, 4)):
        graph = make_llm(checkpoint)
    assert graph.engine.stats().graphs_enabled
    return {"eager": eager, "graph": graph}


@pytest.fixture(params=["eager", "graph"])
def llm(request, engines):
    return engines[request.param]


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


def hf_greedy(model, max_new_tokens=MAX_TOKENS, **kw):
    kw.setdefault("eos_token_id", None)  # run to max_new_tokens, as ignore_eos does
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=0, **kw)
    return out[0, len(PROMPT):].tolist()


def greedy(llm, **kw):
    kw = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **kw}
    return llm.generate([PROMPT], SamplingParams(**kw))[0].outputs[0].token_ids


@pytest.mark.parametrize("penalty", [0.5, 1.5])
def test_repetition_penalty_is_hf_generate(llm, hf_model, penalty):
    want = hf_greedy(hf_model, repetition_penalty=penalty)
    assert greedy(llm, repetition_penalty=penalty) == want
    if penalty < 1:
        assert want != hf_greedy(hf_model)  # the penalty changes this greedy output


def test_logit_bias_is_hf_sequence_bias(llm, hf_model):
    plain = hf_greedy(hf_model)
    bias = {plain[3]: -100.0, 77: 5.0}
    want = hf_greedy(hf_model, sequence_bias=[[[t], b] for t, b in bias.items()])
    assert want != plain
    assert greedy(llm, logit_bias=bias) == want


def round_trips(tokenizer, ids):
    text = tokenizer.decode(ids)
    return text.strip() and tokenizer.encode(text.lstrip(), add_special_tokens=False) == list(ids)


def test_bad_words_are_hf_bad_words_ids(llm, hf_model):
    """bad_words are text: each bans the token sequences bad_word_ids gives it (as written, and after a space);
    HF's NoBadWordsLogitsProcessor gets those same sequences."""
    plain = hf_greedy(hf_model)
    tok = llm.tokenizer
    pair = next(plain[i:i + 2] for i in range(2, len(plain) - 1) if round_trips(tok, plain[i:i + 2]))
    single = next([t] for t in plain[1:] if round_trips(tok, [t]) and t not in pair)
    words = [tok.decode(pair).lstrip(), tok.decode(single).lstrip()]
    banned = [list(ids) for w in words for ids in bad_word_ids(w, tok)]
    assert pair in banned and single in banned
    want = hf_greedy(hf_model, bad_words_ids=banned)
    assert want != plain
    assert greedy(llm, bad_words=words) == want


def test_min_tokens_holds_back_a_stop_token_as_hf_min_new_tokens(llm, hf_model):
    plain = hf_greedy(hf_model)
    stop = plain[2]
    eos = sorted(llm.engine.eos_ids)
    want = hf_greedy(hf_model, min_new_tokens=6, eos_token_id=[stop] + eos)
    assert len(want) > 3 and stop not in want[:6]  # without min_tokens the output would end at token 3
    assert greedy(llm, ignore_eos=False, stop_token_ids=[stop], min_tokens=6) == want
    assert greedy(llm, ignore_eos=False, stop_token_ids=[stop]) == plain[:3]


class OpenAIPenalties(transformers.LogitsProcessor):
    """OpenAI's presence / frequency penalties over the generated tokens, for HF's generate."""

    def __init__(self, presence: float, frequency: float):
        self.presence, self.frequency = presence, frequency

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        generated = input_ids[:, len(PROMPT):]
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


@pytest.mark.parametrize("presence,frequency", [(1.5, 0.0), (0.0, 1.0), (0.5, 0.5)])
def test_presence_and_frequency_are_openai_s(llm, hf_model, presence, frequency):
    """Over a looping output (repetition_penalty < 1 favours repeats), so the penalties have work to do."""
    looping = hf_greedy(hf_model, repetition_penalty=0.5)
    want = hf_greedy(hf_model, repetition_penalty=0.5,
                     logits_processor=transformers.LogitsProcessorList([OpenAIPenalties(presence, frequency)]))
    assert want != looping
    assert greedy(llm, repetition_penalty=0.5, presence_penalty=presence, frequency_penalty=frequency) == want


def test_seeded_sampling_with_penalties_is_the_same_on_both_paths(engines):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True,
                            repetition_penalty=1.2, frequency_penalty=0.4, min_p=0.02)
    eager, graph = (engines[k].generate([PROMPT], params)[0].outputs[0].token_ids for k in ("eager", "graph"))
    assert eager == graph


def test_rows_without_processors_keep_their_tokens_beside_rows_with_them(llm):
    plain = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
             SamplingParams(temperature=0.8, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True)]
    alone = [o.outputs[0].token_ids for o in llm.generate([PROMPT, PROMPT[2:]], plain)]
    penalized = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=0.5,
                               logit_bias={5: 3.0}, bad_words=["a"], min_p=0.1)
    mixed = llm.generate([PROMPT, PROMPT[2:], PROMPT], plain + [penalized])
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone
    assert mixed[2].outputs[0].token_ids != alone[0]
