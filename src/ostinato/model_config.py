"""ModelConfig: the architecture facts of a checkpoint, read from its HF `config.json`.

What the checkpoint says, apart from what the user asked (config.py, which re-exports these). Pure Python.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ostinato.errors import CheckpointError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def looks_like_hub_id(model: str) -> bool:
    """ORG/NAME with nothing that marks a file path (a leading /, ./, ~ or a .gguf ending)."""
    return bool(_HUB_ID.match(model)) and not model.endswith(".gguf") and ".." not in model


def default_served_model_name(model: str) -> str:
    """The name the server answers to: a hub id as given (as vLLM does), else the folder's or file's name."""
    if looks_like_hub_id(model) and not Path(model).exists():
        return model
    return Path(model).resolve().name


SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


# quantization_config's quant_method values the loader reads (model/fp8_weights.py parses the rest of the
# dict; "fp8-at-load" is `--quantization fp8` on a dense checkpoint, never written in a config.json).
QUANT_METHODS = ("compressed-tensors", "fp8")


@dataclass(frozen=True)
class WeightQuantization:
    """How the checkpoint's projection weights are quantized: config.json's quantization_config, kept as
    JSON text (hashable, torch-free) for the model layer to parse."""

    method: str  # compressed-tensors | fp8 | fp8-at-load
    config_json: str = "{}"

    @property
    def kv_cache_scales(self) -> bool:
        """The checkpoint carries calibrated FP8 KV-cache scales (compressed-tensors' kv_cache_scheme)."""
        return json.loads(self.config_json).get("kv_cache_scheme") is not None


def quantization_label(quant: WeightQuantization | None) -> str:
    """The weights' scheme in one word, as /v1/models and /metrics report it: none, fp8-compressed-tensors,
    fp8-block (a block-scaled checkpoint) or fp8-at-load (--quantization fp8)."""
    if quant is None:
        return "none"
    return {"compressed-tensors": "fp8-compressed-tensors", "fp8": "fp8-block"}.get(quant.method, quant.method)


def read_quantization(cfg: dict[str, Any]) -> WeightQuantization | None:
    """config.json's quantization_config -> WeightQuantization, or None for a dense checkpoint. Raises
    CheckpointError naming a quantization method ostinato does not load (GPTQ, AWQ, bitsandbytes, ...)."""
    qc = cfg.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method not in QUANT_METHODS:
        raise CheckpointError(f"config.json's quantization_config has quant_method {method!r}, which ostinato does "
                              f"not load; supported: {', '.join(QUANT_METHODS)} (FP8 weights)")
    return WeightQuantization(method, json.dumps(qc, sort_keys=True))


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the decoder needs, read from an HF `config.json`."""

    architecture: str
    family: str  # llama | mistral | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # RMSNorm on q and k per head before RoPE (Qwen3)
    rope_scaling: dict[str, Any] | None = None
    checkpoint_dtype: str = "float32"  # torch_dtype / dtype written in config.json
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Sliding-window attention (some Mistral checkpoints) is not implemented: attention is full, so such a
    # model is exact only up to this many tokens and max_model_len is capped there.
    sliding_window: int | None = None
    quantization: WeightQuantization | None = None  # None: dense weights in checkpoint_dtype

    @staticmethod
    def from_hf_dict(cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise CheckpointError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; ostinato loads "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            head_dim = cfg.get("head_dim") or hidden // heads
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            rope_scaling = cfg.get("rope_scaling")
            rope_theta = cfg.get("rope_theta")
            # transformers >= 5 may write rope settings under "rope_parameters".
            rope_params = cfg.get("rope_parameters")
            if isinstance(rope_params, dict):
                rope_theta = rope_theta or rope_params.get("rope_theta")
                if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
                    rope_scaling = dict(rope_params)
            if rope_scaling is not None:
                kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
                if kind in (None, "default"):
                    rope_scaling = None
                elif kind != "llama3":
                    raise CheckpointError(
                        f"rope_scaling type {kind!r} is not supported; ostinato supports 'llama3' and none"
                    )
            return ModelConfig(
                architecture=arch,
                family=family,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta or 10000.0),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
                qk_norm=family == "qwen3",
                rope_scaling=rope_scaling,
                checkpoint_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
                eos_token_ids=eos_ids,
                bos_token_id=cfg.get("bos_token_id"),
                sliding_window=(int(cfg["sliding_window"]) if cfg.get("sliding_window")
                                and cfg.get("use_sliding_window", True) else None),
                quantization=read_quantization(cfg),
            )
        except KeyError as e:
            raise CheckpointError(f"config.json lacks the required field {e.args[0]!r}") from None

    @staticmethod
    def from_dir(model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            raise CheckpointError(f"model folder {str(model_dir)!r} does not exist")
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: a model folder needs an HF config.json")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path} is not valid JSON: {e}") from None
        return ModelConfig.from_hf_dict(cfg)
