"""FP8 weights in the decoder: which scheme a checkpoint's quantization_config declares, which projections
become kernels/fp8_linear.Fp8Linear, and how each checkpoint tensor lands in them.

Three sources, one module type:
    compressed-tensors   quant_method "compressed-tensors", float 8-bit weights with per-tensor, per-channel or
                         block weight_scale; read with the compressed-tensors library (imported only here, when
                         such a checkpoint is loaded), whose QuantizationConfig parses and validates the dict
    block FP8            quant_method "fp8" with weight_block_size (128 x 128), scales in weight_scale_inv
                         (despite the name, the factor that dequantizes: W = fp8 * scale_inv)
    fp8 at load          `--quantization fp8` on a 16/32-bit checkpoint: each projection quantized per output
                         channel as it is read (kernels/fp8_linear.quantize_rows)

Which projections are quantized is read off the checkpoint itself: a projection is FP8 where its scale tensor
is stored (so a scheme's `ignore` list, or `modules_to_not_convert`, needs no pattern matching here). The
parts of a fused projection (q | k | v, gate | up) must agree. Embeddings and lm_head always stay dense: the
public FP8 recipes keep lm_head out (llm-compressor's ignore=["lm_head"]), it is tied to the embedding in
the small models, and its rounding moves every logit (greedy ties, logprobs) where a projection's error is
averaged by the layers after it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from torch import nn

from ostinato.config import ModelConfig, WeightQuantization
from ostinato.errors import CheckpointError
from ostinato.kernels.fp8_linear import Fp8Linear, quantize_rows
from ostinato.model.decoder import fused_shards
from ostinato.model.parallel import Placement

SUPPORTED_BLOCK = (128, 128)
# The projections that can hold FP8 weights, by their HF name; the decoder's own module that each lands in.
PROJECTIONS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "o_proj": "o_proj",
               "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}
SCALE_LEAVES = ("weight_scale", "weight_scale_inv")


@dataclass(frozen=True)
class Fp8Scheme:
    """What the loader builds: per-row scales (block None) or block scales of `block` (rows, columns).
    `quantize_at_load`: the checkpoint is dense and ostinato quantizes it (--quantization fp8)."""

    name: str  # what the start-up log, /v1/models and /metrics report
    block: tuple[int, int] | None = None
    quantize_at_load: bool = False


def fp8_scheme(quant: WeightQuantization) -> Fp8Scheme:
    """The scheme `quant` (ModelConfig.quantization) declares. Raises CheckpointError naming an unsupported one."""
    config = json.loads(quant.config_json)
    if quant.method == "fp8-at-load":
        return Fp8Scheme("fp8 (quantized at load, per channel)", quantize_at_load=True)
    if quant.method == "fp8":
        return _block_fp8_scheme(config)
    if quant.method == "compressed-tensors":
        return _compressed_tensors_scheme(config)
    raise CheckpointError(f"quantization method {quant.method!r} is not supported; ostinato loads FP8 checkpoints "
                          "(compressed-tensors float 8-bit, or quant_method 'fp8' with 128x128 blocks)")


def _block_fp8_scheme(config: dict) -> Fp8Scheme:
    block = config.get("weight_block_size")
    if config.get("activation_scheme", "dynamic") != "dynamic":
        raise CheckpointError(f"quant_method 'fp8' with activation_scheme {config['activation_scheme']!r} (static "
                              "input scales) is not supported; ostinato loads dynamic FP8 checkpoints")
    if block is None or tuple(block) != SUPPORTED_BLOCK:
        raise CheckpointError(f"quant_method 'fp8' with weight_block_size {block} is not supported; ostinato loads "
                              f"block-scaled FP8 with {SUPPORTED_BLOCK[0]}x{SUPPORTED_BLOCK[1]} blocks")
    return Fp8Scheme("fp8 block 128x128 (weight_scale_inv)", block=SUPPORTED_BLOCK)


def _check_kv_cache_scheme(kv) -> None:
    """A kv_cache_scheme (calibrated KV-cache scales) is accepted where it is static FP8 E4M3 per tensor, as
    llm-compressor writes it: an FP8 cache applies its k_scale / v_scale (model/kv_scales.py); a cache in the
    model's dtype leaves them unread."""
    if kv is not None and (kv.type != "float" or kv.num_bits != 8 or kv.strategy != "tensor" or kv.dynamic):
        raise CheckpointError(f"compressed-tensors kv_cache_scheme {kv.type}{kv.num_bits} per {kv.strategy} "
                              f"(dynamic {kv.dynamic}) is not supported; ostinato loads static FP8 per-tensor KV "
                              "scales")


def _compressed_tensors_scheme(config: dict) -> Fp8Scheme:
    try:
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError:
        raise CheckpointError("this checkpoint is in the compressed-tensors format: pip install compressed-tensors "
                              "to load it") from None
    if config.get("sparsity_config"):
        sparsity = config["sparsity_config"].get("format", "sparse")
        raise CheckpointError(f"compressed-tensors sparsity ({sparsity}, e.g. 2:4) is not supported; ostinato "
                              "loads dense FP8 weights")
    try:
        parsed = QuantizationConfig.model_validate(config)
    except ValueError as e:
        raise CheckpointError(f"config.json's quantization_config is not a valid compressed-tensors config: {e}")
    strategies = set()
    for name, group in parsed.config_groups.items():
        w, act = group.weights, group.input_activations
        if w is None or w.type != "float" or w.num_bits != 8:
            what = "no weight quantization" if w is None else f"{w.type}{w.num_bits} weights"
            raise CheckpointError(f"compressed-tensors scheme {name!r} has {what}; ostinato loads FP8 (float 8-bit) "
                                  "weights only (int4/int8 schemes such as W4A16 are not supported)")
        if w.strategy not in ("tensor", "channel", "block"):
            raise CheckpointError(f"compressed-tensors scheme {name!r}: weight strategy {w.strategy!r} is not "
                                  "supported (tensor, channel and 128x128 block are)")
        if w.strategy == "block" and tuple(w.block_structure or ()) != SUPPORTED_BLOCK:
            raise CheckpointError(f"compressed-tensors scheme {name!r}: block_structure {w.block_structure} is not "
                                  "supported; ostinato loads 128x128 blocks")
        if act is not None and not act.dynamic:
            raise CheckpointError(f"compressed-tensors scheme {name!r} has static input activation scales; "
                                  "ostinato loads weight-only or dynamic-activation FP8")
        if group.output_activations is not None:
            raise CheckpointError(f"compressed-tensors scheme {name!r} quantizes its outputs; ostinato loads FP8 "
                                  "weights only")
        strategies.add(w.strategy)
    _check_kv_cache_scheme(parsed.kv_cache_scheme)
    if len(strategies) != 1:
        raise CheckpointError(f"compressed-tensors config mixes weight strategies {sorted(strategies)}; ostinato "
                              "loads one strategy per checkpoint")
    strategy = strategies.pop()
    block = SUPPORTED_BLOCK if strategy == "block" else None
    return Fp8Scheme(f"compressed-tensors fp8 (per-{strategy} weight scales)", block=block)


def swap_projections(model: nn.Module, scheme: Fp8Scheme, checkpoint_names: set[str]) -> dict[str, Fp8Linear]:
    """Replace the projections that hold FP8 weights (all of them when quantizing at load; else those whose
    scales the checkpoint stores) by Fp8Linear, on the meta device. Returns {module path: Fp8Linear}."""
    config: ModelConfig = model.config
    parts_of: dict[str, list[str]] = {}
    for hf, ours in PROJECTIONS.items():
        parts_of.setdefault(ours, []).append(hf)
    swapped = {}
    for i, layer in enumerate(model.model.layers):
        for parent_name, parent in (("self_attn", layer.self_attn), ("mlp", layer.mlp)):
            for ours, hf_parts in parts_of.items():
                dense = getattr(parent, ours, None)
                if dense is None:
                    continue
                prefix = f"model.layers.{i}.{parent_name}."
                stored = [any(f"{prefix}{hf}.{leaf}" in checkpoint_names for leaf in SCALE_LEAVES) for hf in hf_parts]
                if not scheme.quantize_at_load and not any(stored):
                    continue
                if not scheme.quantize_at_load and not all(stored):
                    raise CheckpointError(f"{prefix}{'/'.join(hf_parts)}: some parts have FP8 scales and some not; "
                                          "ostinato fuses these projections and needs them all FP8 or all dense")
                if scheme.block is not None:
                    _check_block_aligned(config, ours, scheme.block)
                fp8 = Fp8Linear(dense.in_features, dense.out_features, dense.bias is not None, scheme.block)
                setattr(parent, ours, fp8)
                swapped[f"{prefix}{ours}"] = fp8
    return swapped


def _check_block_aligned(config: ModelConfig, fused: str, block: tuple[int, int]) -> None:
    for hf, (ours, first, rows) in fused_shards(config).items():
        if ours == fused and (first % block[0] or rows % block[0]):
            raise CheckpointError(f"{hf} has {rows} rows from row {first} of {fused}: block-scaled FP8 needs the "
                                  f"fused parts to start and end on {block[0]}-row blocks")


def place_fp8_tensor(module: Fp8Linear, scheme: Fp8Scheme, leaf: str, tensor: torch.Tensor,
                     place: Placement, hf_name: str) -> list[str]:
    """Copy one checkpoint tensor (`leaf` weight, weight_scale or weight_scale_inv of one HF projection) into
    `module`'s parameters, rows as `place` says for a fused part. Returns the canonical names it filled
    (HF projection + weight / weight_scale), for the loader's completeness check."""
    hf_module = hf_name.rpartition(".")[0]
    start = place.dest_start or 0
    if leaf == "weight":
        rows = tensor.shape[0]
        if tensor.shape[1:] != module.weight.shape[1:] or start + rows > module.out_features:
            raise CheckpointError(f"tensor {hf_name} has shape {tuple(tensor.shape)}, which does not fit "
                                  f"{tuple(module.weight.shape)} rows from {start}; config.json does not match")
        if scheme.quantize_at_load or tensor.dtype != module.weight.dtype:
            if not scheme.quantize_at_load:
                raise CheckpointError(f"tensor {hf_name} is {tensor.dtype}, but the checkpoint stores its FP8 "
                                      "scales: expected float8_e4m3fn weights")
            q, scale = quantize_rows(tensor.to(torch.float32))
            module.weight[start:start + rows].copy_(q)
            module.weight_scale[start:start + rows].copy_(scale)
            return [f"{hf_module}.weight", f"{hf_module}.weight_scale"]
        module.weight[start:start + rows].copy_(tensor)
        return [f"{hf_module}.weight"]
    rows = _part_rows(module, place)
    if module.block is None:  # per row: a per-tensor scale ([] or [1]) repeats over the part's rows
        if tensor.numel() == 1:
            tensor = tensor.reshape(1).expand(rows)
        dest = module.weight_scale[start:start + rows]
        tensor = tensor.reshape(-1)
    else:
        dest = module.weight_scale[start // module.block[0]:(start + rows) // module.block[0]]
    if tensor.shape != dest.shape:
        raise CheckpointError(f"tensor {hf_name} has shape {tuple(tensor.shape)}, the FP8 projection expects "
                              f"scales of shape {tuple(dest.shape)}; the scales do not match the weight's layout")
    dest.copy_(tensor)
    return [f"{hf_module}.weight_scale"]


def _part_rows(module: Fp8Linear, place: Placement) -> int:
    """Rows of the weight one HF part fills: its share of a fused projection, or all of them."""
    if place.dest_start is None:
        return module.out_features
    return place.src_end - place.src_start


def expected_fp8_names(swapped: dict[str, Fp8Linear]) -> set[str]:
    """The canonical names (HF projection + weight / weight_scale) the swapped projections need filled."""
    by_fused: dict[str, list[str]] = {}
    for hf, ours in PROJECTIONS.items():
        by_fused.setdefault(ours, []).append(hf)
    names = set()
    for path in swapped:
        parent, _, ours = path.rpartition(".")
        for hf in by_fused[ours]:
            names.update((f"{parent}.{hf}.weight", f"{parent}.{hf}.weight_scale"))
    return names
