"""Speculative decoding's settings (a leaf, like config.py: no torch, none of the layers).

`SpeculativeConfig` is what the engine and the runner get; `speculative_config(args)` checks the flags of an
EngineArgs (vLLM's names: speculative_method, num_speculative_tokens, prompt_lookup_min / prompt_lookup_max,
speculative_model) and returns it, or None when speculation is off. Every combination the engine cannot serve
is refused here with the flag to change.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ostinato.errors import ConfigError
from ostinato.model_config import ModelConfig

SPECULATIVE_METHODS = ("ngram", "draft")
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
# A verify row carries k + 1 tokens; past this the step's extra positions cost more than a low acceptance buys.
MAX_NUM_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """method "ngram": prompt lookup over a sequence's own tokens (engine/ngram_proposer.py) proposes up to
    num_speculative_tokens tokens per step, matched on its last n tokens, n from prompt_lookup_max down to
    prompt_lookup_min. method "draft": a second, smaller model of the same vocabulary (speculative_model; its
    HF folder and config once EngineArgs.resolve read them: with_draft) proposes num_speculative_tokens tokens
    per step by as many decode steps of its own (runner/draft.py)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    speculative_model: str | None = None  # as given (a folder, a .gguf file, a hub id)
    draft_model_dir: str | None = None  # the HF folder it names, once resolved
    draft_model: ModelConfig | None = None

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft"

    def describe(self) -> str:
        if self.uses_draft_model:
            return (f"draft model {self.speculative_model}, {self.num_speculative_tokens} proposed tokens a step")
        return (f"{self.method}, up to {self.num_speculative_tokens} proposed tokens a step, prompt lookup over "
                f"{self.prompt_lookup_min}..{self.prompt_lookup_max}-grams")


def with_draft(spec: SpeculativeConfig, draft_dir: str, draft: ModelConfig, target: ModelConfig
               ) -> SpeculativeConfig:
    """spec with its draft model's folder and config, checked against the target's: the draft's proposals are
    token ids of the target's vocabulary, and its distribution q is compared with the target's p token by
    token, so both must have the same vocabulary."""
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(f"--speculative-model {spec.speculative_model} has a vocabulary of {draft.vocab_size} "
                          f"tokens, the model {target.vocab_size}: a draft model must share the model's tokenizer "
                          "and vocabulary (take a smaller model of the same family)")
    return replace(spec, draft_model_dir=draft_dir, draft_model=draft)


def decode_rows_per_sequence(spec: SpeculativeConfig | None) -> int:
    """The decode-graph rows a running sequence may take in a step: one, or with speculation k + 1 (a verify
    row's positions, flattened into decode rows: runner/verify_rows.py). The decode graphs are planned up to
    --max-num-seqs times this."""
    return 1 if spec is None else spec.num_speculative_tokens + 1


def speculative_config(args) -> SpeculativeConfig | None:
    """The speculative settings of an EngineArgs (checked), or None when --speculative-method is not set."""
    method, k = args.speculative_method, args.num_speculative_tokens
    if method is None:
        if k is not None or args.speculative_model is not None:
            raise ConfigError("--num-speculative-tokens and --speculative-model need --speculative-method "
                              "(ngram or draft); set it, or drop them")
        return None
    if method not in SPECULATIVE_METHODS:
        raise ConfigError(f"--speculative-method must be one of {', '.join(SPECULATIVE_METHODS)}, got {method!r}")
    if method == "draft" and args.speculative_model is None:
        raise ConfigError("--speculative-method draft needs --speculative-model PATH: a smaller model with the "
                          "model's tokenizer")
    if method != "draft" and args.speculative_model is not None:
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
    return SpeculativeConfig(method, k, lo, hi, speculative_model=args.speculative_model)


def resolve_speculative(args, model: ModelConfig, draft_model_dir=None) -> SpeculativeConfig | None:
    """speculative_config(args) with, for --speculative-method draft, the draft model's config read from
    draft_model_dir (the folder --speculative-model names; default the flag itself) and checked (with_draft)."""
    spec = speculative_config(args)
    if spec is None or not spec.uses_draft_model:
        return spec
    draft_dir = str(draft_model_dir if draft_model_dir is not None else args.speculative_model)
    return with_draft(spec, draft_dir, ModelConfig.from_dir(draft_dir), model)
