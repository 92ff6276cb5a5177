"""A request's logits processors in token ids (contract.LogitsSpec), resolved once when it is added.

Only the engine knows the vocabulary and the tokenizer: it checks logit_bias's ids against the one, turns
bad_words into token sequences with the other (as vLLM: each word as written and with a leading space, the
second kept only when it is not the first with a space token in front), and gives min_tokens the ids it bans
(EOS unless ignore_eos, and stop_token_ids).
"""

from __future__ import annotations

from ostinato.contract import LogitsSpec
from ostinato.errors import InvalidRequestError
from ostinato.sampling_params import SamplingParams

# A bad word may be at most this many tokens: the device keeps each row's last outputs to match them.
MAX_BAD_WORD_TOKENS = 8
# min_tokens bans at most this many ids (EOS and stop_token_ids): a fixed-width device table holds them.
MAX_MIN_TOKENS_BAN = 64


def resolve_logits_spec(params: SamplingParams, stop_ids: frozenset[int], tokenizer,
                        vocab_size: int) -> LogitsSpec | None:
    """The request's LogitsSpec, or None when it uses no logits processor."""
    if not params.processes_logits:
        return None
    bad = [t for t, _ in params.logit_bias if t >= vocab_size]
    if bad:
        raise InvalidRequestError(f"logit_bias keys must be token ids in [0, {vocab_size}) (the model's "
                                  f"vocabulary); got {bad[:5]}", param="logit_bias")
    ban = tuple(sorted(stop_ids)) if params.min_tokens > 0 else ()
    if len(ban) > MAX_MIN_TOKENS_BAN:
        raise InvalidRequestError(f"min_tokens bans the {len(ban)} stop token ids, at most {MAX_MIN_TOKENS_BAN} "
                                  "are allowed: send fewer stop_token_ids", param="min_tokens")
    words = tuple(w for word in params.bad_words for w in bad_word_ids(word, tokenizer))
    return LogitsSpec(params, ban, words)


def bad_word_ids(word: str, tokenizer) -> list[tuple[int, ...]]:
    """The token sequences a bad word bans: as written, and with a leading space (a word inside a text)."""
    out: list[tuple[int, ...]] = []
    for prefix in ("", " "):
        ids = tuple(tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))
        if not ids:
            continue
        if prefix and out and (ids[0] == out[-1][0] or len(ids) != len(out[-1])):
            continue  # the space became a token of its own, or the split changed: not the same word
        if len(ids) > MAX_BAD_WORD_TOKENS:
            raise InvalidRequestError(f"bad word {word!r} is {len(ids)} tokens long; at most "
                                      f"{MAX_BAD_WORD_TOKENS} are allowed", param="bad_words")
        out.append(ids)
    return out
