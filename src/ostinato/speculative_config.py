"""Speculative decoding's settings (a leaf, like config.py: no torch, none of the layers).

`SpeculativeConfig` is what the engine and the runner get; `speculative_config(args)` checks the flags of an
EngineArgs (vLLM's names: speculative_method, num_speculative_tokens, prompt_lookup_min / prompt_lookup_max,
speculative_model) and returns it, or None when speculation is off. Every combination the engine cannot serve
is refused here with the flag to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from ostinato.errors import ConfigError

SPECULATIVE_METHODS = ("ngram", "draft")
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
# A verify row carries k + 1 tokens; past this the step's extra positions cost more than a low acceptance buys.
MAX_NUM_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """method "ngram": prompt lookup over a sequence's own tokens (engine/ngram_proposer.py) proposes up to
    num_speculative_tokens tokens per step, matched on its last n tokens, n from prompt_lookup_max down to
    prompt_lookup_min."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int

    def describe(self) -> str:
        return (f"{self.method}, up to {self.num_speculative_tokens} proposed tokens a step, prompt lookup over "
                f"{self.prompt_lookup_min}..{self.prompt_lookup_max}-grams")


def speculative_config(args) -> SpeculativeConfig | None:
    """The speculative settings of an EngineArgs (checked), or None when --speculative-method is not set."""
    method, k = args.speculative_method, args.num_speculative_tokens
    if method is None:
        if k is not None or args.speculative_model is not None:
            raise ConfigError("--num-speculative-tokens and --speculative-model need --speculative-method "
                              "(ngram); set it, or drop them")
        return None
    if method not in SPECULATIVE_METHODS:
        raise ConfigError(f"--speculative-method must be one of {', '.join(SPECULATIVE_METHODS)}, got {method!r}")
    if method == "draft":
        raise ConfigError("--speculative-method draft (a second, smaller model) is not implemented yet; use "
                          "--speculative-method ngram")
    if args.speculative_model is not None:
        raise ConfigError("--speculative-model is for --speculative-method draft; ngram needs no model: drop it")
    k = DEFAULT_NUM_SPECULATIVE_TOKENS if k is None else k
    if not isinstance(k, int) or not 1 <= k <= MAX_NUM_SPECULATIVE_TOKENS:
        raise ConfigError(f"--num-speculative-tokens must be an integer in [1, {MAX_NUM_SPECULATIVE_TOKENS}], "
                          f"got {k!r}")
    lo, hi = args.prompt_lookup_min, args.prompt_lookup_max
    if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
        raise ConfigError(f"--prompt-lookup-min and --prompt-lookup-max must be integers with 1 <= min <= max, "
                          f"got {lo!r} and {hi!r}")
    if args.tensor_parallel_size != 1:
        raise ConfigError("--speculative-method needs --tensor-parallel-size 1 (the verify step runs on one "
                          "rank); drop one of the two flags")
    if args.batch_invariant:
        raise ConfigError("--speculative-method cannot be used with --batch-invariant: a verified token is "
                          "computed by the prefill kernels, a decoded one by the decode kernel, so a request's "
                          "bits would depend on what was proposed; drop one of the two flags")
    return SpeculativeConfig(method, k, lo, hi)
