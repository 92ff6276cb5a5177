"""Calibrated FP8 KV-cache scales (compressed-tensors' kv_cache_scheme: one static k_scale and v_scale a layer, as
llm-compressor writes them) applied by folding them into the weights at load, not into the attention kernels.

The scheme stores K / k_scale and V / v_scale in the FP8 cache and multiplies them back when attention reads them.
Every step between a projection and the cache is linear or scale-free, so the division goes into the weights that
make K and V: the k and v rows of qkv_proj (their FP8 row or block scales, in fp32; dense rows and bias rounded once
more to their dtype), or, where Qwen3 normalises each k head, the k_norm weight (RMSNorm's output does not depend on
its input's scale). On the read side k_scale goes into the softmax scale (q . (k_scale K') = k_scale (q . K')) and
v_scale into o_proj, whose input is the attention output (o_proj(v_scale x) = (v_scale W) x + b). So every attention
backend and kernel, the CUDA graphs and the prefix cache see one FP8 cache whatever the scales, and a step costs
what it costs without them. A checkpoint's scales are used only with an FP8 cache (--kv-cache-dtype fp8); with the
model's dtype they are not read."""

from __future__ import annotations

import math

import torch
from torch import nn

from ostinato.errors import CheckpointError
from ostinato.kernels.fp8_linear import Fp8Linear
from ostinato.model.decoder import fused_shards

KV_SCALE_LEAVES = ("k_scale", "v_scale")
# The checkpoint tensors a kv_cache_scheme adds to every layer; the loader reads them only for an FP8 cache.
KV_SCALE_SUFFIXES = tuple(f"self_attn.{leaf}" for leaf in KV_SCALE_LEAVES)


def _scale_of(scales: dict[str, torch.Tensor], name: str) -> float:
    tensor = scales.get(name)
    if tensor is None:
        raise CheckpointError(f"the checkpoint's kv_cache_scheme calibrates KV-cache scales, but {name} is not "
                              "stored; the checkpoint is incomplete")
    if tensor.numel() != 1:
        raise CheckpointError(f"{name} has shape {tuple(tensor.shape)}: ostinato applies one KV-cache scale a layer "
                              "(kv_cache_scheme strategy tensor)")
    value = float(tensor.reshape(()).item())
    if not math.isfinite(value) or value <= 0:
        raise CheckpointError(f"{name} is {value}: a KV-cache scale must be positive and finite")
    return value


@torch.no_grad()
def _scale_rows(module: nn.Module, start: int, rows: int, factor: float, bias: bool = True) -> None:
    """Rows [start, start + rows) of a projection's output times `factor`: through an FP8 projection's row or
    block scales (fp32, so the weights themselves stay as stored), else the dense rows; and their bias."""
    if isinstance(module, Fp8Linear):
        if module.block is None:
            module.weight_scale[start:start + rows] *= factor
        else:  # the loader checked that a fused part starts and ends on a block (fp8_weights._check_block_aligned)
            module.weight_scale[start // module.block[0]:(start + rows) // module.block[0]] *= factor
    else:
        part = module.weight[start:start + rows]
        part.copy_(part.float() * factor)
    if bias and module.bias is not None:
        part = module.bias[start:start + rows]
        part.copy_(part.float() * factor)


@torch.no_grad()
def fold_kv_cache_scales(model: nn.Module, scales: dict[str, torch.Tensor]) -> tuple[float, float]:
    """Folds every layer's k_scale / v_scale (checkpoint name -> tensor) into its weights and softmax scale, as the
    module docstring says. Returns the largest k_scale and v_scale, for the start-up log."""
    config = model.config
    shards = fused_shards(config)
    _, k_start, kv_rows = shards["k_proj"]
    _, v_start, _ = shards["v_proj"]
    largest = [0.0, 0.0]
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        k_scale, v_scale = (_scale_of(scales, f"model.layers.{i}.self_attn.{leaf}") for leaf in KV_SCALE_LEAVES)
        if attn.qk_norm:
            attn.k_norm.weight.copy_(attn.k_norm.weight.float() / k_scale)
        else:
            _scale_rows(attn.qkv_proj, k_start, kv_rows, 1 / k_scale)
        _scale_rows(attn.qkv_proj, v_start, kv_rows, 1 / v_scale)
        _scale_rows(attn.o_proj, 0, attn.o_proj.out_features, v_scale, bias=False)
        attn.scale *= k_scale
        largest = [max(largest[0], k_scale), max(largest[1], v_scale)]
    return largest[0], largest[1]
