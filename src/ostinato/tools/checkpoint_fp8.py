"""FP8 layouts of `ostinato make-checkpoint --quantization fp8` (tools/checkpoint.py): the random projection weights
quantized to E4M3 and stored as the public FP8 checkpoints store them, with the quantization_config that
declares them, so that bench, verify and advise run the same files a user would download.

    compressed-tensors   llm-compressor's FP8_DYNAMIC: per-channel `weight_scale` [N, 1], dynamic per-token
                         activations; the config written by the compressed-tensors library itself
    block                quant_method "fp8", 128 x 128 blocks, `weight_scale_inv` [cdiv(N, 128), cdiv(K, 128)]
                         (the layout of Qwen3's and DeepSeek's FP8 releases)
Embeddings, norms and lm_head stay in the checkpoint's dtype (model/fp8_weights.py says why).
"""

from __future__ import annotations

from typing import Any

FP8_LAYOUTS = ("compressed-tensors", "block")
BLOCK = (128, 128)
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_projection_weight(name: str) -> bool:
    module, _, leaf = name.rpartition(".")
    return leaf == "weight" and module.rpartition(".")[2] in _PROJECTIONS


def quantization_config(layout: str) -> dict[str, Any]:
    """config.json's quantization_config for `layout`."""
    if layout == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(BLOCK)}
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme

    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])},
                                format="float-quantized", quantization_status=QuantizationStatus.COMPRESSED,
                                ignore=["lm_head"])
    return config.model_dump(mode="json", exclude_none=True)


def scale_name(weight_name: str, layout: str) -> str:
    return weight_name + ("_scale_inv" if layout == "block" else "_scale")


def quantize_block(weight, block: tuple[int, int] = BLOCK):
    """A dense [N, K] weight -> (fp8 [N, K], float32 [cdiv(N, bn), cdiv(K, bk)]): each block's largest
    magnitude mapped to the E4M3 maximum."""
    import torch
    import torch.nn.functional as F

    from ostinato.kernels.fp8_linear import FP8_DTYPE, FP8_MAX

    n, k = weight.shape
    bn, bk = block
    w = F.pad(weight.float(), (0, -k % bk, 0, -n % bn))  # whole blocks; the padding is cut off below
    blocks = w.view(w.shape[0] // bn, bn, w.shape[1] // bk, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / FP8_MAX  # [N / bn, K / bk]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view_as(w)[:n, :k]
    return q.to(FP8_DTYPE).contiguous(), scale.contiguous()


def to_fp8_layout(tensors: dict[str, Any], layout: str) -> dict[str, Any]:
    """One shard's dense tensors -> the same shard in `layout`: each projection weight quantized, its scale
    stored beside it."""
    from ostinato.kernels.fp8_linear import quantize_rows

    out = {}
    for name, tensor in tensors.items():
        if not is_projection_weight(name):
            out[name] = tensor
            continue
        if layout == "block":
            out[name], out[scale_name(name, layout)] = quantize_block(tensor)
        else:
            q, scale = quantize_rows(tensor.float())
            out[name], out[scale_name(name, layout)] = q, scale[:, None].contiguous()
    return out
