"""A sequence being served. Pure Python (no torch): the scheduler and block manager are tested on CPU.

What crosses to the runner (ScheduledSeq, SchedulerOutput) lives in ostinato/contract.py; it is
re-exported here for the engine's callers.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from ostinato.contract import LogitsSpec, ScheduledSeq, SchedulerOutput  # noqa: F401 (re-exported)
from ostinato.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "abort"  # client went away / abort() called

    @property
    def finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                        SequenceStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Sequence:
    """One generation stream: prompt tokens, generated tokens, and where its KV lives.

    num_computed_tokens counts the tokens whose K/V are in the cache (or being written by a launched step).
    After preemption (recompute) the blocks are freed and num_computed_tokens drops to 0; the next prefill
    recomputes the prompt and everything generated so far, less what the prefix cache still holds.
    """

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    # Tokens sampled by a launched step whose value the engine has not read yet (overlapped scheduling:
    # 0 or 1). The scheduler plans with num_tokens + num_inflight.
    num_inflight: int = 0
    # Chunked prefill: True once the chunk that reaches the last token is scheduled (the sequence then holds a
    # decode row); False while its prompt (or a recompute) is still being prefilled, chunk by chunk.
    decoding: bool = False
    # Prefix caching (engine/blocks.py): the keys of its full blocks, computed once and kept (tokens only
    # grow); how many leading blocks of block_table carry a key; the prompt tokens found cached at its first
    # admission (None before it), as the OpenAI usage and RequestOutput.num_cached_tokens report them.
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    num_cached_tokens: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    logits_spec: LogitsSpec | None = None  # its logits processors in token ids (None: it uses none)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_range(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end) (end <= num_tokens): one chunk, one block or the token a decode step
        feeds, without copying every token of the sequence (O(end - start), not O(length))."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n_prompt]

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]
