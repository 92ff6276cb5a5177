"""The engine flags every command shares (generate, serve, bench, verify), shaped like vLLM's."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from ostinato.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_PREFILL_GRAPH_MAX_SEQS, DEFAULT_PREFILL_GRAPH_TOKENS, MIXED_STEPS,
    PDL_MODES, EngineArgs, read_cuda_graph_sizes, read_int_list, read_prefill_graph_tokens,
)
from ostinato.config_readers import KV_CACHE_DTYPES
from ostinato.errors import ConfigError
from ostinato.speculative_config import DEFAULT_NUM_SPECULATIVE_TOKENS, SPECULATIVE_METHODS


def arg_type(read: Callable[[str], tuple[int, ...]]) -> Callable[[str], tuple[int, ...]]:
    """An argparse type from a config reader: the reader's ConfigError becomes argparse's usage error."""
    def parse(text: str) -> tuple[int, ...]:
        try:
            return read(text)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = read.__name__  # argparse names the type in some messages
    return parse


# Integers as one flag's text ('1 2 4 8' or '1,2,4,8'): the type of every list-of-sizes flag of the tools.
int_list = arg_type(read_int_list)


def read_queue_bound(text: str) -> int | None:
    """--max-queued-requests: a count, or 'none' for an unbounded waiting queue."""
    if text.strip().lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'none', got {text!r}") from None


def read_decode_tuning(text: str):
    """--decode-tuning: a JSON object of the Triton decode attention's settings (kernels/decode_plan.DecodeTuning's
    fields but pdl, which --pdl sets) -> a DecodeTuning. Each value must have its default's type."""
    import json
    from dataclasses import fields

    from ostinato.kernels.decode_plan import DecodeTuning

    try:
        given = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"splits\": 8}}', got {text!r} ({e})") \
            from None
    if not isinstance(given, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"splits\": 8}}', got {text!r}")
    defaults = {f.name: f.default for f in fields(DecodeTuning) if f.name != "pdl"}
    for name, value in given.items():
        if name not in defaults:
            raise argparse.ArgumentTypeError(f"no decode setting {name!r}; the settings: {', '.join(defaults)}")
        if not _same_kind(value, defaults[name]):
            kind = "int or null" if defaults[name] is None else type(defaults[name]).__name__
            raise argparse.ArgumentTypeError(f"decode setting {name} takes {kind}, got {json.dumps(value)}")
    try:
        return DecodeTuning(**given)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


DECODE_TUNING_HELP = ("the Triton decode attention's launch settings as JSON, for measuring them (the fields of "
                      "kernels/decode_plan.DecodeTuning, e.g. '{\"splits\": 8}' or '{\"quantize_output\": false}'; "
                      "default: its defaults; CUDA only)")


def _same_kind(value, default) -> bool:
    """Whether a JSON value fits a setting whose default is `default` (None: an int or null; JSON's true is
    not an int here)."""
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(default, bool)
    if default is None:
        return value is None or isinstance(value, int)
    return isinstance(value, type(default))


def _queue_bound_help(default: int | None) -> str:
    what = ("sequences that may wait for a slot (a request with n counts n); past it a request gets HTTP 429 "
            "with Retry-After, and 'none' lifts the bound")
    if default is None:
        return f"{what} (default: none, a batch job queues all its prompts)"
    return (f"{what} (default: {default}, one more batch of the default --max-num-seqs: a queued request starts "
            "within about one batch's lifetime, and past that a client hears 429 at once instead of waiting "
            "unbounded under a full KV cache)")


def _prefill_cap_default(offline: bool) -> str:
    if offline:
        return "the step budget, no cap, as the offline API's"
    return (f"the largest prefill graph, {DEFAULT_PREFILL_GRAPH_TOKENS[-1]} tokens unless --prefill-graph-tokens "
            "says, less --max-num-seqs, and at least half that graph")


def add_engine_args(p: argparse.ArgumentParser, *, offline: bool = False,
                    max_queued_requests: int | None = None) -> None:
    """The engine flags. offline: a command that runs the LLM API in-process (generate, bench engine, throughput
    and spec): the server's flags are left out, and its prompt chunks are uncapped by default (step_policy.py).
    max_queued_requests: the waiting queue's default bound (`serve`'s: config.SERVER_MAX_QUEUED_REQUESTS)."""
    p.add_argument("model", help="HF model folder (config.json, *.safetensors, tokenizer files), a .gguf file, "
                                 "a hub id such as Qwen/Qwen3-0.6B (from the HF cache, or downloaded), or a "
                                 "short name: smollm2-135m")
    g = p.add_argument_group("engine")
    g.add_argument("--revision", default=None,
                   help="branch, tag or commit of a hub id (default: the repository's main)")
    g.add_argument("--gguf-dequantize", action="store_true",
                   help="a GGUF model: convert it once to a cached float32 folder and run that in --dtype, "
                        "instead of keeping its projections in their GGUF blocks (the default)")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    g.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=f"tokens per step, decode rows and prefill chunks together (default max("
                        f"{DEFAULT_MAX_NUM_BATCHED_TOKENS}, --max-num-seqs)): a longer prompt is prefilled in chunks "
                        "while running sequences decode")
    g.add_argument("--max-prefill-tokens-while-decoding", type=int, default=None, metavar="N",
                   help="most prompt tokens a step that also decodes running sequences carries, so a stream's "
                        "next token waits behind at most N prompt tokens (default: "
                        f"{_prefill_cap_default(offline)}; a step with nothing to decode always fills "
                        "the budget)")
    _add_kv_cache_args(g)
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="sampling defaults for what a request leaves unset: auto (the model's "
                        "generation_config.json), vllm (none: ostinato's own) or a folder holding one")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs: decode and prefill steps run eager")
    g.add_argument("--cuda-graph-sizes", type=arg_type(read_cuda_graph_sizes), default=None,
                   help="batch sizes to capture, e.g. '1 2 4 8 16', or @FILE (as `ostinato advise` writes)")
    g.add_argument("--max-cuda-graph-size", type=int, default=None)
    g.add_argument("--cuda-graph-fallback", default="error", choices=["error", "eager"],
                   help="what a capture failure does: stop start-up (default) or run eager, visibly")
    g.add_argument("--prefill-graph-tokens", type=arg_type(read_prefill_graph_tokens), default=None,
                   help="token counts at which prefill steps (and chunks beside running decodes) run as CUDA-graph "
                        "replays, e.g. '16 32 64 128 256'; 'none' runs every prefill eager (default: 16 to 512 "
                        "in 1.5x steps, up to --max-num-batched-tokens; --enforce-eager turns them off too)")
    g.add_argument("--prefill-graph-max-seqs", type=int, default=DEFAULT_PREFILL_GRAPH_MAX_SEQS,
                   help="most sequences one prefill graph step holds; a step with more runs eager")
    g.add_argument("--mixed-step", choices=MIXED_STEPS, default=MIXED_STEPS[0],
                   help="a step with decode rows and prefill chunks: one prefill-graph replay for both when it "
                        "fits a captured token count (reads the weights once; default), or the decode replay "
                        "then the chunks")
    g.add_argument("--pdl", choices=PDL_MODES, default=PDL_MODES[0],
                   help="programmatic dependent launch of the Triton kernels (Hopper and newer): each may start "
                        "while the one before it finishes; auto uses it where the GPU and triton support it, on "
                        "fails start-up where they do not")
    g.add_argument("--decode-tuning", type=read_decode_tuning, default=None, metavar="JSON", help=DECODE_TUNING_HELP)
    g.add_argument("--batch-invariant", action="store_true",
                   help="every kernel reduces a request's rows in an order set by that request alone: its tokens "
                        "and logprobs are the same whatever runs beside it, padding and chunking (slower; "
                        "unquantized checkpoints, one GPU)")
    g.add_argument("--quantization", choices=["fp8"], default=None,
                   help="fp8: quantize a 16/32-bit checkpoint's projections to FP8 E4M3 at load, per output channel "
                        "(half the bytes a decode step reads; embeddings and lm_head stay as stored). FP8 "
                        "checkpoints (compressed-tensors, block-scaled) run as FP8 without it")
    g.add_argument("--skip-graph-check", action="store_true",
                   help="skip the start-up replay-vs-eager check of every captured graph")
    if not offline:
        g.add_argument("--served-model-name", default=None)
        g.add_argument("--max-queued-requests", type=read_queue_bound, default=max_queued_requests,
                       help=_queue_bound_help(max_queued_requests))
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over N GPUs (one process each, NCCL); under torchrun, the number of "
                        "ranks (see README: Tensor parallelism)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="overlap scheduling with the GPU: launch decode step n+1 before reading step n's tokens "
                        "(--no-async-scheduling waits for each step)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV cache of full blocks of earlier requests' identical prefixes "
                        "(--no-enable-prefix-caching computes every prompt whole)")
    add_speculative_args(p)


def _add_kv_cache_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="fixed KV block count instead of sizing from GPU memory")
    g.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                   help="the KV cache's element type: auto (the model's dtype) or fp8 (E4M3: half the bytes a "
                        "cached token, so twice the tokens in the same memory, at FP8's rounding of every key and "
                        "value; a checkpoint's calibrated KV scales are applied where it has them)")


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    """Speculative decoding's flags (speculative_config.py checks them), vLLM's names."""
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--speculative-method", choices=SPECULATIVE_METHODS, default=None,
                   help="propose tokens cheaply and verify them in one forward: ngram looks the sequence's last "
                        "tokens up in its own prompt and output, draft runs --speculative-model (the output's "
                        "distribution, and greedy output, are unchanged)")
    s.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help=f"tokens proposed per step (default {DEFAULT_NUM_SPECULATIVE_TOKENS})")
    s.add_argument("--prompt-lookup-min", "--ngram-min", type=int, default=1, metavar="N",
                   help="smallest n-gram ngram matches on")
    s.add_argument("--prompt-lookup-max", "--ngram-max", type=int, default=4, metavar="N",
                   help="largest n-gram ngram matches on (tried first)")
    s.add_argument("--speculative-model", default=None, metavar="PATH",
                   help="the draft model of --speculative-method draft: a smaller model with the same "
                        "tokenizer (a folder, a .gguf file or a hub id)")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    fields = EngineArgs.field_names()
    return EngineArgs(**{k: v for k, v in vars(ns).items() if k in fields})
