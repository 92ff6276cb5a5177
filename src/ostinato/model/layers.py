"""Building blocks of the decoder: RMSNorm, rotary embedding (default and llama3 scaling), SwiGLU MLP, and the
output projection kept quantized.

Each block is written to match HF transformers numerically (fp32 on CPU agrees to ~1e-6) while keeping
the number of kernels per decode step low, since inside a CUDA graph every kernel still costs ~2 us.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), normalised in float32 as HF does.

    `F.rms_norm` upcasts to float32 internally (and is a single fused kernel on recent CUDA builds).
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: dict[str, Any] | None,
                  max_position_embeddings: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, exactly as HF's ROPE_INIT_FUNCTIONS compute them.

    Supports the default RoPE and the `llama3` type (Llama 3.1+): long wavelengths are divided by
    `factor`, short ones kept, the band in between interpolated smoothly.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if rope_scaling is None:
        return inv_freq
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r}")  # ModelConfig rejects these first
    factor = rope_scaling["factor"]
    low_freq_factor = rope_scaling["low_freq_factor"]
    high_freq_factor = rope_scaling["high_freq_factor"]
    old_context_len = rope_scaling.get("original_max_position_embeddings", max_position_embeddings)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """A cos/sin table for every position up to max_position_embeddings, indexed by position.

    The table is computed in float32 (as HF does) and stored in the model dtype (HF casts cos/sin to the
    activations' dtype before use). Layout: [max_positions, 2 * head_dim] = [cos | signed sin], so one
    gather per forward serves every layer. "Signed sin" folds rotate_half's negation into the table:
    rotate_half(x) * sin == cat(x2, x1) * [-sin1, sin2], which saves a negation kernel per call.
    """

    def __init__(self, head_dim: int, max_position_embeddings: int, theta: float,
                 rope_scaling: dict[str, Any] | None):
        super().__init__()
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        self.theta = theta
        self.rope_scaling = rope_scaling
        # On the default device. The loaders build the model on the meta device and rebuild() the table on the real
        # one, so there it is only a shape: computing it on meta goes through torch._refs, whose first call imports
        # torch._dynamo (seconds of every start-up).
        if torch.get_default_device().type == "meta":
            table = torch.empty(max_position_embeddings, 2 * head_dim)
        else:
            table = self._compute(None, torch.float32)
        self.register_buffer("cos_sin_cache", table, persistent=False)

    def _compute(self, device: torch.device | None, dtype: torch.dtype) -> torch.Tensor:
        # Like HF: inverse frequencies on the host, the position products and cos/sin on the device.
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.rope_scaling, self.max_position_embeddings)
        positions = torch.arange(self.max_position_embeddings, dtype=torch.int64, device=device)
        freqs = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        half = self.head_dim // 2
        sin = emb.sin()
        signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return torch.cat((emb.cos(), signed_sin), dim=-1).to(dtype)  # [P, 2D]

    def rebuild(self, device: torch.device, dtype: torch.dtype) -> None:
        """Recompute the table on `device` (the loader builds the model on the meta device)."""
        self.cos_sin_cache = self._compute(device, dtype)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, signed_sin), each [T, 1, head_dim] to broadcast over heads."""
        cos_sin = self.cos_sin_cache.index_select(0, positions)  # [T, 2D]
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)
        return cos, sin


class SwiGLUMLP(nn.Module):
    """The weights of down(silu(gate(x)) * up(x)), gate and up fused into one matmul (rows: gate then up).

    DecoderLayer runs it through its kernel set (kernels/decoder_kernels.DecoderKernels.norm_then_mlp), so that the
    norm before it and the activation can fold into gate_up's kernel, or the activation into the kernel that
    prepares down's input (GGUF's integer-dot rows).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, down_proj: nn.Module | None = None):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        # Tensor parallelism passes a row-parallel down projection (model/parallel.py); same shape.
        self.down_proj = down_proj if down_proj is not None else nn.Linear(intermediate_size, hidden_size, bias=False)


class QuantizedLMHead(nn.Module):
    """The output projection kept in a quantized layout (a QuantizedLinear: a GGUF file's Q6_K or Q8_0 head,
    model/gguf_weights.py), in place of VocabParallelLMHead on one rank. `weight` is None: nothing dense is held.

    Why: the head is the largest single projection (the 8B's 128256 x 4096 is 1.05 GB in bf16, 0.46 GB in padded
    Q6_K), read whole every decode step."""

    weight = None

    def __init__(self, linear: nn.Module, vocab_size: int):
        super().__init__()
        self.linear = linear
        self.vocab_size = vocab_size

    def logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size]: float32 straight from the kernels' accumulators
        (compute_logits says why), or in hidden's dtype."""
        out = torch.empty(hidden.shape[0], self.vocab_size, device=hidden.device,
                          dtype=torch.float32 if float32 else hidden.dtype)
        self.linear.linear_into(hidden, out)
        return out

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden, float32=False)

    def assemble(self, local_logits: torch.Tensor) -> torch.Tensor:
        return local_logits  # one rank: quantized heads are never split
