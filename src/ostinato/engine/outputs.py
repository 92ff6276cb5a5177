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
    """One of a request's n completions. What text, token_ids and logprobs hold depends on the request's
    SamplingParams.output_kind: everything so far (CUMULATIVE, FINAL_ONLY) or what is new since the
    request's previous output (DELTA).

    While unfinished, text holds back a tail that could still become a stop string, so a streaming client
    never sees part of one. finish_reason: None while running, then "stop", "length" or "abort".
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None

    def add(self, later: "CompletionOutput") -> None:
        """Append a later DELTA of the same completion (O(size of the delta))."""
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        if later.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(later.logprobs)
        self.finish_reason = later.finish_reason


@dataclass
class RequestOutput:
    """A request's output at one step. With DELTA, `outputs` holds only the completions that advanced this
    step (match them by CompletionOutput.index); `finished` is True on the request's last output."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None

    def add(self, later: "RequestOutput") -> None:
        """Fold a later DELTA output of the same request into this one, in place: what a stream consumer that
        fell behind does with the deltas that queued up, and how deltas reassemble into the whole output."""
        by_index = {c.index: c for c in self.outputs}
        for c in later.outputs:
            mine = by_index.get(c.index)
            if mine is None:
                mine = CompletionOutput(c.index, "", [], None, [] if c.logprobs is not None else None)
                self.outputs.append(mine)
                by_index[c.index] = mine
            mine.add(c)
        self.outputs.sort(key=lambda c: c.index)
        self.finished = later.finished
        self.first_token_time = self.first_token_time or later.first_token_time
        self.finished_time = later.finished_time


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
