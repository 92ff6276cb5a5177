"""Readers and planners of the engine flags that hold lists of sizes: what the user wrote (a flag's text, a
file, a list) turned into checked tuples, and the default sizes planned from the other flags.

Pure Python and a leaf like config.py (which re-exports these), so the CLI, the tools and the config share one
parser per flag; each raises ConfigError with a message naming the flag.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

from ostinato.errors import ConfigError, InvalidRequestError
from ostinato.sampling_params import GENERATION_CONFIG_FIELDS, SamplingParams

logger = logging.getLogger("ostinato.config")


def read_int_list(text: str) -> tuple[int, ...]:
    """Integers as a flag's text: '1 2 4 8' or '1,2,4,8'."""
    try:
        return tuple(int(x) for x in text.replace(",", " ").split())
    except ValueError:
        raise ConfigError(f"expected integers like '1 2 4 8' or '1,2,4,8', got {text!r}") from None


def default_capture_sizes(max_num_seqs: int, max_size: int = 256) -> tuple[int, ...]:
    """1, 2, 4, then steps of 8 up to min(max_size, max_num_seqs); the cap itself is always included."""
    cap = max(1, min(max_size, max_num_seqs))
    sizes = [s for s in (1, 2, 4) if s <= cap] + list(range(8, cap + 1, 8))
    if sizes[-1] != cap:
        sizes.append(cap)
    return tuple(sorted(set(sizes)))


def plan_capture_sizes(
    max_num_seqs: int,
    cuda_graph_sizes: Sequence[int] | None = None,
    max_cuda_graph_size: int | None = None,
    rows_per_sequence: int = 1,
) -> tuple[int, ...]:
    """The batch sizes to capture, ascending.

    Default: 1, 2, 4, then steps of 8 up to min(max_cuda_graph_size or 256, max_num_seqs), that cap
    included. An explicit list is sorted and deduplicated; sizes above max_num_seqs (a decode batch never
    has more sequences) or above max_cuda_graph_size are dropped with a WARNING saying why.
    rows_per_sequence: the decode rows a sequence may take in a step (k + 1 with speculation,
    speculative_config.decode_rows_per_sequence); the largest decode batch is max_num_seqs times it.
    """
    if max_num_seqs < 1:
        raise ConfigError(f"--max-num-seqs must be >= 1, got {max_num_seqs}")
    if max_cuda_graph_size is not None and max_cuda_graph_size < 1:
        raise ConfigError(f"--max-cuda-graph-size must be >= 1, got {max_cuda_graph_size}")
    max_rows = max_num_seqs * rows_per_sequence
    if cuda_graph_sizes is None:
        return default_capture_sizes(max_rows, max_cuda_graph_size or 256)

    sizes = tuple(cuda_graph_sizes)
    bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, int) or s < 1]
    if not sizes or bad:
        raise ConfigError(f"--cuda-graph-sizes must be positive integers, got {list(sizes)}")
    kept, dropped = [], []
    for size in sorted(set(sizes)):
        if size > max_rows:
            per_seq = "" if rows_per_sequence == 1 else f" x {rows_per_sequence} verify positions a sequence"
            dropped.append(f"{size} (above --max-num-seqs {max_num_seqs}{per_seq}: no decode batch is that large)")
        elif max_cuda_graph_size is not None and size > max_cuda_graph_size:
            dropped.append(f"{size} (above --max-cuda-graph-size {max_cuda_graph_size})")
        else:
            kept.append(size)
    if not kept:
        raise ConfigError(
            f"none of --cuda-graph-sizes {sorted(set(sizes))} can be used: {'; '.join(dropped)}. Pass sizes "
            "<= --max-num-seqs (and --max-cuda-graph-size), or run with --enforce-eager"
        )
    if dropped:
        logger.warning("not capturing CUDA graphs for --cuda-graph-sizes %s", "; ".join(dropped))
    return tuple(kept)


# Token counts of the captured prefill graphs. Why these (H200, llama-3.1-8b, bf16): an eager forward of up to
# ~480 tokens costs ~11 ms of host-side launches whatever its size, while its GPU work is ~4-5 ms at 96-224
# tokens; by ~512 tokens the GPU work (~21 us a token: 43 ms at 2016) catches up with the launches, so above
# that a graph saves little and eager runs. The 1.5x steps bound padding to a third of a replay's tokens.
# Graph memory is that of the largest size (all sizes share one pool): its activations, tens of MiB on the 8B.
DEFAULT_PREFILL_GRAPH_TOKENS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# A captured prefill step holds up to this many sequences (a chunk beside running decodes is one; a burst of
# short prompts more). Unused sequence slots cost one early-returning program per query tile and KV head.
DEFAULT_PREFILL_GRAPH_MAX_SEQS = 16
MIXED_STEPS = ("one-replay", "two-replays")
PDL_MODES = ("auto", "on", "off")  # --pdl (kernels/pdl.py)
KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3"}  # --kv-cache-dtype (vLLM's names)


def read_kv_cache_dtype(value: str) -> str:
    """--kv-cache-dtype as the runner takes it: "auto" (the model's dtype) or "fp8_e4m3" ("fp8" names it too)."""
    if value not in KV_CACHE_DTYPES:
        raise ConfigError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {value!r}")
    return KV_CACHE_DTYPES[value]


def plan_prefill_graph_tokens(max_num_batched_tokens: int, given: Sequence[int] | None = None) -> tuple[int, ...]:
    """The prefill token counts to capture, ascending. Default: DEFAULT_PREFILL_GRAPH_TOKENS below the step's
    token budget, plus the budget itself when it is within the largest (a step never holds more tokens, and a
    chunk that fills the budget then replays unpadded). Given sizes above the budget are dropped (no step holds
    that many tokens; warn_dropped_prefill_graph_tokens says so); an empty tuple turns prefill graphs off. Pure:
    the step policy plans them too (step_policy.py), and the capture's plan warns once."""
    if given is None:
        sizes = [s for s in DEFAULT_PREFILL_GRAPH_TOKENS if s < max_num_batched_tokens]
        if max_num_batched_tokens <= DEFAULT_PREFILL_GRAPH_TOKENS[-1]:
            sizes.append(max_num_batched_tokens)
        return tuple(sorted(set(sizes)))
    return tuple(sorted({s for s in given if s <= max_num_batched_tokens}))


def warn_dropped_prefill_graph_tokens(given: Sequence[int] | None, planned: Sequence[int], budget: int) -> None:
    """A WARNING naming the given --prefill-graph-tokens that plan_prefill_graph_tokens dropped."""
    dropped = sorted(set(given or ()) - set(planned))
    if dropped:
        logger.warning("not capturing prefill graphs for --prefill-graph-tokens %s: above "
                       "--max-num-batched-tokens %d, no step holds that many tokens", dropped, budget)


def read_prefill_graph_tokens(text: str) -> tuple[int, ...]:
    """--prefill-graph-tokens as written: integers ('16 32 64' or '16,32,64'), or 'none' (no prefill graphs)."""
    if text.strip().lower() in ("none", "off", ""):
        return ()
    try:
        sizes = tuple(int(w) for w in text.replace(",", " ").split())
    except ValueError:
        raise ConfigError(f"--prefill-graph-tokens must hold integers like '16 32 64' or 'none', "
                          f"got {text!r}") from None
    if any(s < 1 for s in sizes):
        raise ConfigError(f"--prefill-graph-tokens must hold positive integers, got {list(sizes)}")
    return sizes


def read_cuda_graph_sizes(text: str) -> tuple[int, ...]:
    """--cuda-graph-sizes as the user wrote it: integers ('1 2 4 8' or '1,2,4,8'), or '@FILE' naming a file
    that holds them (what `ostinato advise` writes): whitespace/comma separated, '#' starts a comment; a
    JSON list or a JSON object with a "cuda_graph_sizes" list is accepted too."""
    source = "--cuda-graph-sizes"
    if text.startswith("@"):
        path = Path(text[1:])
        source = f"--cuda-graph-sizes file {str(path)!r}"
        try:
            text = path.read_text()
        except OSError as e:
            raise ConfigError(f"cannot read {source}: {e.strerror or e}; pass an existing file after '@'") from None
        stripped = text.strip()
        if stripped.startswith(("[", "{")):
            try:
                value = json.loads(stripped)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{source} is not valid JSON: {e}") from None
            if isinstance(value, dict):
                value = value.get("cuda_graph_sizes")
            if not isinstance(value, list):
                raise ConfigError(f'{source} must hold a JSON list of sizes or {{"cuda_graph_sizes": [...]}}')
            text = " ".join(str(v) for v in value)
        text = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    words = text.replace(",", " ").split()
    try:
        sizes = tuple(int(w) for w in words)
    except ValueError:
        raise ConfigError(f"{source} must hold integers like '1 2 4 8' or '1,2,4,8', got {text.strip()!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise ConfigError(f"{source} must hold positive integers, got {list(sizes)}")
    return sizes


def read_generation_defaults(source: str, model_dir: str | Path) -> tuple[dict, Path | None]:
    """The sampling defaults --generation-config names, as vLLM reads them: "auto" the model folder's
    generation_config.json (none when it has none), "vllm" none at all, else a folder holding one. Returns
    (SamplingParams fields -> values, the file read or None); a bad file is a ConfigError naming it."""
    if source == "vllm":
        return {}, None
    folder = Path(model_dir) if source == "auto" else Path(source)
    path = folder / "generation_config.json"
    if not path.is_file():
        if source == "auto":
            return {}, None
        raise ConfigError(f"--generation-config {source}: {path} does not exist; name a folder holding a "
                          "generation_config.json, or use auto (the model's) or vllm (none)")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not readable JSON ({e}); fix it or pass --generation-config vllm") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path} must hold a JSON object; fix it or pass --generation-config vllm")
    defaults = {ours: cfg[hf] for hf, ours in GENERATION_CONFIG_FIELDS.items() if cfg.get(hf) is not None}
    try:
        SamplingParams(**defaults)
    except InvalidRequestError as e:
        raise ConfigError(f"{path}: {e}; fix it or pass --generation-config vllm") from None
    return defaults, path
