"""What the engine keeps per request and per sequence between steps: the text released so far, the logprobs,
and how much of them DELTA outputs already handed out."""

from __future__ import annotations

from dataclasses import dataclass, field

from ostinato.engine.detokenizer import IncrementalDetokenizer, OutputText
from ostinato.engine.outputs import TokenLogprob
from ostinato.engine.request import Sequence
from ostinato.sampling_params import SamplingParams


@dataclass
class SeqState:
    """One sequence's bookkeeping: its text and logprobs, and how much of them DELTA outputs handed out."""

    seq: Sequence
    index: int
    detok: IncrementalDetokenizer
    text: OutputText  # released text, cut at a stop string once one is found
    stop_ids: frozenset[int]  # token ids that end it: EOS (unless ignore_eos) and stop_token_ids
    max_output: int  # output tokens at which it ends ("length"): max_tokens, or what max_model_len leaves
    # Its text is needed before it finishes (a stream, or stop strings to look for); else it is decoded once,
    # when the sequence finishes, and a step only records its token.
    text_per_step: bool
    constrained: bool = False  # its tokens follow a grammar (ConstrainedRequests.rows holds its matcher)
    logprobs: list[TokenLogprob] | None = None
    # Each token's own text (engine/token_texts.py), for a streamed sequence without stop strings or logprobs
    # and a byte-level tokenizer; used while on_table, i.e. while its text so far ends on a whole character.
    texts: dict[int, str | None] | None = None
    on_table: bool = False
    finish_reason: str | None = None
    sent_tokens: int = 0  # DELTA: output tokens (and logprobs) already in an output
    sent_pieces: int = 0  # DELTA: pieces of text.pieces already in an output
    sent_finish: bool = False  # DELTA: the finish reason went out


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seqs: list[SeqState] = field(default_factory=list)
    first_token_time: float | None = None
    finished_time: float | None = None
    num_unfinished: int = 0  # sequences without a finish reason (LLMEngine._finish counts them down)

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0
