"""FP8 checkpoints for the tests: the dense fp32 copy HF transformers runs as the reference (weight x scale)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ostinato.kernels.fp8_linear import dequantize_fp8
from ostinato.tools.checkpoint_fp8 import BLOCK

SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv")


def dequantized_copy(src: Path, dst: Path) -> Path:
    """`src` (an FP8 checkpoint as make-checkpoint writes it, one file) with every FP8 weight replaced by its
    float32 dequantization and the quantization_config dropped: the same model, dense."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    dense = {}
    for name, tensor in tensors.items():
        if name.endswith(SCALE_SUFFIXES):
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            scale, block = tensors.get(f"{name}_scale"), None
            if scale is None:
                scale, block = tensors[f"{name}_scale_inv"], BLOCK
            tensor = dequantize_fp8(tensor, scale.reshape(-1) if block is None else scale, block)
        dense[name] = tensor.float().contiguous()
    save_file(dense, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
