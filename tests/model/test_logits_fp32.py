"""Float32 logits straight from the 16-bit lm_head (model/decoder.compute_logits), on CPU.

bf16 logits step by 0.125 near 16, so greedy flips on exact ties; compute_logits must not round to 16 bits
first, and under tensor parallelism it must still hand back the full vocabulary (the all-gather).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ostinato.attention.torch_ref import TorchRefBackend
from ostinato.config import ModelConfig
from ostinato.model.decoder import DecoderForCausalLM
from ostinato.model.parallel import TPGroup
from ostinato.tools.checkpoint import hf_config_dict


def _model(tp: TPGroup | None = None) -> DecoderForCausalLM:
    torch.manual_seed(0)
    config = ModelConfig.from_hf_dict(hf_config_dict("tiny"))
    model = DecoderForCausalLM(config, TorchRefBackend(), **({"tp": tp} if tp else {}))
    for p in model.parameters():
        p.normal_(0, 1.0)
    return model.to(torch.bfloat16)


def test_bf16_model_gives_unrounded_float32_logits():
    model = _model()
    hidden = torch.randn(3, model.config.hidden_size).to(torch.bfloat16)
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (3, model.config.vocab_size)
    exact = hidden.double() @ model.lm_head.weight.double().t()
    assert (logits.double() - exact).abs().max() < 1e-3 * exact.abs().max()
    # Not bf16 values in disguise: rounding them to bf16 changes most of them.
    assert (logits.to(torch.bfloat16).float() != logits).float().mean() > 0.5
    # float32=False keeps the model dtype (what the bf16 path gives).
    assert model.compute_logits(hidden, float32=False).dtype == torch.bfloat16


@dataclass(frozen=True)
class _MirrorTP(TPGroup):
    """Two ranks without a process group: the other rank's logits are this rank's, negated."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, -x], dim=1)


def test_float32_logits_are_assembled_across_tensor_parallel_ranks():
    model = _model(_MirrorTP(rank=0, world_size=2))
    vocab, rows = model.config.vocab_size, model.lm_head.weight.shape[0]
    assert rows == -(-vocab // 2)
    hidden = torch.randn(2, model.config.hidden_size).to(torch.bfloat16)
    logits = model.compute_logits(hidden)
    assert logits.shape == (2, vocab) and logits.dtype == torch.float32
    local = hidden.float() @ model.lm_head.weight.float().t()
    torch.testing.assert_close(logits[:, :rows], local)
    torch.testing.assert_close(logits[:, rows:], -local[:, :vocab - rows])
