"""What the engine reads from a model's folder before it starts: the tokenizer, the EOS ids, and the resolved
engine config (the folder a GGUF file or a short name becomes)."""

from __future__ import annotations

from pathlib import Path

from ostinato.config import EngineArgs, EngineConfig, ModelConfig
from ostinato.model.gguf_sources import resolve_model_dir
from ostinato.model.hub import check_tokenizer_folder


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    check_tokenizer_folder(path)  # a folder without one: a CheckpointError naming the files, not a traceback

    return AutoTokenizer.from_pretrained(str(path))


def eos_token_ids(model_dir: str | Path, model_config: ModelConfig, tokenizer) -> frozenset[int]:
    """EOS ids from config.json, generation_config.json and the tokenizer: any of them ends a sequence."""
    ids = set(model_config.eos_token_ids)
    gen_cfg = Path(model_dir) / "generation_config.json"
    if gen_cfg.is_file():
        import json

        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def resolve_engine_config(args: EngineArgs) -> EngineConfig:
    """args.resolve() on what only the layers below know: the HF folder args.model names (a GGUF file or short
    name, e.g. smollm2-135m, gives its metadata folder, or with --gguf-dequantize a cached float32 folder) and
    the device --device auto picks."""
    from ostinato.runner.runner import pick_device  # torch lives below this line of the dependency graph

    model_dir = resolve_model_dir(args.model, args.revision, args.gguf_dequantize)
    draft_dir = None if args.speculative_model is None else resolve_model_dir(args.speculative_model, None,
                                                                              args.gguf_dequantize)
    return args.resolve(model_dir, pick_device(args.device).type, draft_dir)
