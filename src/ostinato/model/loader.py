"""Load an HF safetensors checkpoint (single file or sharded) into `DecoderForCausalLM`.

The model is built on the meta device (no memory, no random init), then every parameter is allocated
once on the target device and filled straight from the safetensors files: each tensor is read onto the
device and copied (with dtype conversion) into its place, fused q/k/v and gate/up by row slice. Anything
the checkpoint lacks, or has but the decoder cannot place, raises CheckpointError naming the tensor.
A GGUF file's metadata folder (model/gguf_native.py) is loaded from the file instead (model/gguf_weights.py).
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from ostinato.attention.base import AttentionBackend
from ostinato.config import ModelConfig
from ostinato.errors import CheckpointError, ConfigError
from ostinato.kernels.quantized_linear import QuantizedLinear
from ostinato.model.decoder import DecoderForCausalLM, fused_shards
from ostinato.model.fp8_weights import (SCALE_LEAVES, Fp8Scheme, expected_fp8_names, fp8_scheme, place_fp8_tensor,
                                        swap_projections)
from ostinato.model.gguf_native import is_native_gguf_dir
from ostinato.model.kv_scales import KV_SCALE_SUFFIXES, fold_kv_cache_scales
from ostinato.model.parallel import (SINGLE_RANK, Placement, TPGroup, VocabParallelEmbedding, VocabParallelLMHead,
                                     placement_of, placements)

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Tensors some checkpoints carry that hold nothing to load (old Llama exports saved the RoPE table).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

_DTYPES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
}


def resolve_dtype(name: str, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    """The dtype to run in. "auto" = the checkpoint's dtype on GPU, float32 on CPU (CPU matmuls in
    bf16/fp16 are slow and it is the reference path)."""
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        name = model_config.checkpoint_dtype.removeprefix("torch.")
        if name not in _DTYPES:
            raise ConfigError(f"config.json declares dtype {model_config.checkpoint_dtype!r}, which ostinato "
                              "cannot run; pass --dtype bfloat16, float16 or float32")
    if name not in _DTYPES:
        raise ConfigError(f"--dtype must be auto, bfloat16, float16 or float32, got {name!r}")
    return _DTYPES[name]


def weights_nbytes(model: nn.Module) -> int:
    """Bytes held by the model's weights: its quantized projections' own tensors (QuantizedLinear.weight_bytes,
    a projection inside another counted by the outer) and every other parameter (a tied embedding counted once)."""
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    inner = {id(c) for m in quantized for c in m.modules() if c is not m}
    owned = {id(p) for m in quantized for p in m.parameters()}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in owned) \
        + sum(m.weight_bytes() for m in quantized if id(m) not in inner)


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name in the checkpoint to the safetensors file that holds it."""
    single, index = model_dir / SINGLE_FILE, model_dir / INDEX_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e}); re-save the checkpoint")
        files = {name: model_dir / shard for name, shard in weight_map.items()}
        missing = sorted({str(p) for p in files.values() if not p.is_file()})
        if missing:
            raise CheckpointError(f"{index} names shard(s) that are missing: {', '.join(missing)}; "
                                  "download or copy the complete checkpoint")
        return files
    hint = ""
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
        hint = " (found PyTorch .bin/.pt weights: convert them to safetensors, e.g. with save_pretrained)"
    raise CheckpointError(f"{model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")


def _expected_checkpoint_names(model: DecoderForCausalLM, fp8_modules: dict[str, QuantizedLinear]) -> set[str]:
    """The HF tensor names the model needs (fused parameters expand into their HF parts; an FP8 projection's
    weight and scales by their canonical names, model/fp8_weights.py)."""
    by_fused: dict[str, list[str]] = defaultdict(list)
    for proj, (fused, _, _) in fused_shards(model.config).items():
        by_fused[fused].append(proj)
    names = expected_fp8_names(fp8_modules)
    for name, _ in model.named_parameters():  # a tied lm_head is deduplicated away here
        module_path, _, leaf = name.rpartition(".")
        parent, _, module = module_path.rpartition(".")
        if module_path in fp8_modules and leaf != "bias":
            continue
        if module in by_fused:
            names.update(f"{parent}.{proj}.{leaf}" for proj in by_fused[module])
        else:
            names.add(name)
    return names


def materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give every meta parameter uninitialised storage on `device`, keeping shared (tied) ones shared.
    (`Module.to_empty` would untie them.) A quantized projection keeps its weight's and scales' own dtypes;
    its bias, like every other parameter, takes the model's."""
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in new:
                keep = isinstance(module, QuantizedLinear) and name != "bias"
                new[id(param)] = nn.Parameter(torch.empty(param.shape, device=device,
                                                          dtype=param.dtype if keep else dtype), requires_grad=False)
            setattr(module, name, new[id(param)])


def _safetensors_device(device: torch.device) -> str:
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def _check_complete(model_dir: Path, model_config: ModelConfig, model: DecoderForCausalLM,
                    fp8_modules: dict[str, QuantizedLinear], loaded: set[str], unexpected: list[str]) -> None:
    """Raise CheckpointError if a checkpoint tensor had no place in the decoder, or the decoder lacks one."""
    if unexpected:
        raise CheckpointError(
            f"{model_dir}: {len(unexpected)} checkpoint tensor(s) have no place in the {model_config.family} "
            f"decoder built from config.json, e.g. {', '.join(sorted(unexpected)[:5])}; the checkpoint uses "
            "features ostinato does not implement or config.json does not match the weights")
    missing = sorted(_expected_checkpoint_names(model, fp8_modules) - loaded)
    if missing:
        raise CheckpointError(
            f"{model_dir}: {len(missing)} tensor(s) the model needs are not in the checkpoint, e.g. "
            f"{', '.join(missing[:5])}; the checkpoint is incomplete or config.json does not match it")


def _copy_into(param: torch.Tensor, place: Placement, tensor: torch.Tensor, what: str) -> None:
    """A dense checkpoint tensor into its parameter (or its rows of a fused one)."""
    dest = param
    if place.dest_start is not None:
        rows = place.src_end - place.src_start if place.src_dim == 0 else tensor.shape[0]
        dest = dest[place.dest_start:place.dest_start + rows]
    if tensor.shape != dest.shape:
        raise CheckpointError(f"{what} has shape {tuple(tensor.shape)}, the model built from config.json expects "
                              f"{tuple(dest.shape)}; config.json does not match the weights")
    dest.copy_(tensor)


def _apply_kv_cache_scales(model: DecoderForCausalLM, model_dir: Path, scales: dict[str, torch.Tensor] | None) -> None:
    """A checkpoint's calibrated KV-cache scales: folded in for an FP8 cache (`scales` read), else left unread."""
    if scales is None:
        logger.info("%s: the checkpoint's calibrated KV-cache scales (kv_cache_scheme) are left unused: the KV cache "
                    "runs in the model's dtype (--kv-cache-dtype fp8 applies them)", model_dir)
        return
    k_max, v_max = fold_kv_cache_scales(model, scales)
    logger.info("KV cache: the checkpoint's calibrated FP8 scales folded into the k, v and o projections and the "
                "softmax scale (largest k_scale %.4g, v_scale %.4g)", k_max, v_max)


def load_model(model_dir: str | Path, model_config: ModelConfig, dtype: torch.dtype, device: torch.device,
               backend: AttentionBackend, progress: bool = True, tp: TPGroup = SINGLE_RANK,
               fp8_kv_cache: bool = False) -> DecoderForCausalLM:
    """Build the decoder and fill it from `model_dir`'s safetensors files. Raises CheckpointError.

    Under tensor parallelism (`tp`) only this rank's part of each split tensor is read from disk and placed
    on `device` (model/parallel.py says which part), so no rank ever holds the whole model. fp8_kv_cache: the
    KV cache will be FP8, so a checkpoint's calibrated KV-cache scales are folded in (model/kv_scales.py)."""
    model_dir = Path(model_dir)
    if is_native_gguf_dir(model_dir):  # a GGUF file's metadata folder: the blocks come from the file
        from ostinato.model.gguf_weights import load_gguf_model  # it builds on this module

        return load_gguf_model(model_dir, model_config, dtype, device, backend, tp)
    files = checkpoint_files(model_dir)
    with torch.device("meta"):
        model = DecoderForCausalLM(model_config, backend, tp)
    if "lm_head.weight" not in files and not model.tied:
        logger.info("%s has no lm_head.weight: tying the output projection to embed_tokens", model_dir)
        model.tie_weights()
    scheme = fp8_scheme(model_config.quantization) if model_config.quantization is not None else None
    kv_scales = model_config.quantization is not None and model_config.quantization.kv_cache_scales
    kv_scale_tensors: dict[str, torch.Tensor] = {}
    fp8_modules = swap_projections(model, scheme, set(files)) if scheme is not None else {}
    model.quantization_name = scheme.name if scheme is not None else None
    materialize(model, device, dtype)
    model.model.rotary_emb.rebuild(device, dtype)
    with torch.no_grad():  # the last rank's vocabulary padding rows are never loaded: keep them zero
        for module in model.modules():
            if isinstance(module, (VocabParallelEmbedding, VocabParallelLMHead)) and tp.world_size > 1:
                module.weight.zero_()

    params = dict(model.named_parameters())
    table = placements(model_config, tp)
    unexpected: list[str] = []
    loaded: set[str] = set()
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name, path in files.items():
        by_file[path].append(name)

    with torch.no_grad(), tqdm(total=len(files), desc="Loading weights", unit="tensor",
                               disable=not progress) as bar:
        for path, names in by_file.items():
            with safe_open(str(path), framework="pt", device=_safetensors_device(device)) as f:
                for hf_name in names:
                    bar.update(1)
                    if hf_name.endswith(IGNORED_SUFFIXES) or (hf_name == "lm_head.weight" and model.tied):
                        continue  # a tied checkpoint may still store a copy of lm_head
                    if kv_scales and hf_name.endswith(KV_SCALE_SUFFIXES):
                        if fp8_kv_cache:
                            kv_scale_tensors[hf_name] = f.get_tensor(hf_name).float().cpu()
                        continue
                    place = placement_of(hf_name, table, tp)
                    module_path, _, leaf = place.param.rpartition(".")
                    if module_path in fp8_modules and leaf in ("weight", *SCALE_LEAVES):
                        tensor = f.get_tensor(hf_name) if leaf in SCALE_LEAVES else place.read(f, hf_name)
                        loaded.update(place_fp8_tensor(fp8_modules[module_path], scheme, leaf, tensor, place,
                                                       hf_name))
                        continue
                    if place.param not in params:
                        unexpected.append(hf_name)
                        continue
                    _copy_into(params[place.param], place, place.read(f, hf_name), f"{path.name}: tensor {hf_name}")
                    loaded.add(hf_name)

    _check_complete(model_dir, model_config, model, fp8_modules, loaded, unexpected)
    if kv_scales:
        _apply_kv_cache_scales(model, model_dir, kv_scale_tensors if fp8_kv_cache else None)
    logger.info("loaded %d tensors (%.2f GiB) from %s", len(loaded), weights_nbytes(model) / 2**30, model_dir)
    if scheme is not None:
        logger.info("weights: %s in %d projections, %.2f GiB of the %.2f GiB (embeddings and lm_head as stored)",
                    scheme.name, len(fp8_modules), sum(m.weight_bytes() for m in fp8_modules.values()) / 2**30,
                    weights_nbytes(model) / 2**30)
    return model.eval()


def quantization_name(model: nn.Module) -> str | None:
    """The FP8 scheme of a loaded model, or None for dense weights: what /v1/models and /metrics report."""
    return getattr(model, "quantization_name", None)
