"""What the engine hands back: per-request outputs and engine-wide statistics. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # top-N (token id, logprob), best first


@dataclass
class CompletionOutput:
    """One of a request's n completions. text and token_ids are cumulative.

    While unfinished, text holds back a tail that could still become a stop string, so a streaming client
    never sees part of one. finish_reason: None while running, then "stop", "length" or "abort".
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_usage: float
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    decode_steps_graph: int
    decode_steps_eager: int
    padded_rows: int
    replays_by_size: dict[int, int]
    captured_sizes: tuple[int, ...]
    graph_memory_bytes: int
    graph_capture_seconds: float
    graphs_enabled: bool
    graph_disabled_cause: str | None
    # Decode steps by their real batch size (graph and eager alike): the server's decode_batch_size histogram.
    decode_batch_sizes: dict[int, int] = field(default_factory=dict)
    max_num_seqs: int = 0
