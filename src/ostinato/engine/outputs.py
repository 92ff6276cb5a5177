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
    # Prompt tokens found in the prefix cache at admission (not recomputed), as vLLM's num_cached_tokens.
    num_cached_tokens: int = 0


# A step's output of one request as the engine core sends it (engine/step_outputs.py builds them):
# (request_id, [(index, text, token_ids, finish_reason, logprobs) per completion], finished, first_token_time,
#  finished_time, num_cached_tokens). The prompt, its ids and the arrival time are known to the receiver.
CompletionRecord = tuple[int, str, list[int], "str | None", "list[TokenLogprob] | None"]
OutputRecord = tuple[str, list[CompletionRecord], bool, "float | None", "float | None", int]


def output_from_record(record: OutputRecord, prompt: str | None, prompt_token_ids: list[int],
                       arrival_time: float) -> RequestOutput:
    """The RequestOutput a record stands for, given what the record leaves out."""
    request_id, comps, finished, first_token_time, finished_time, num_cached = record
    return RequestOutput(request_id, prompt, prompt_token_ids, [CompletionOutput(*c) for c in comps], finished,
                         arrival_time, first_token_time, finished_time, num_cached)


def merge_deltas(deltas: list[RequestOutput]) -> RequestOutput:
    """Join consecutive DELTA outputs of one request into one output, in O(their total size).

    A stream consumer that fell behind merges the deltas that queued up; merging all of a request's deltas
    gives what a FINAL_ONLY request returns.
    """
    last = deltas[-1]
    if len(deltas) == 1:
        return last
    texts: dict[int, list[str]] = {}
    merged: dict[int, CompletionOutput] = {}
    for delta in deltas:
        for c in delta.outputs:
            m = merged.get(c.index)
            if m is None:
                m = merged[c.index] = CompletionOutput(c.index, "", [], None,
                                                       [] if c.logprobs is not None else None)
                texts[c.index] = []
            texts[c.index].append(c.text)
            m.token_ids.extend(c.token_ids)
            if c.logprobs is not None:
                m.logprobs.extend(c.logprobs)
            m.finish_reason = c.finish_reason
    for index, m in merged.items():
        m.text = "".join(texts[index])
    first_token_time = next((d.first_token_time for d in deltas if d.first_token_time is not None), None)
    return RequestOutput(last.request_id, last.prompt, last.prompt_token_ids,
                         [merged[i] for i in sorted(merged)], last.finished, last.arrival_time,
                         first_token_time, last.finished_time, last.num_cached_tokens)


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
    # Tensor parallelism: one {"rank", "alive", "error"} per rank (empty for a single rank); /health reads it.
    ranks: tuple[dict, ...] = ()
    # Prefix caching, in tokens (vLLM's counters): tokens of admitted sequences looked up, and found cached.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Triton kernels compiled after start-up, i.e. inside a live step (runner/compile_watch.py).
    kernel_compiles_in_service: int = 0
    # Prefill steps (a mixed step's chunks included) by how they ran: a CUDA-graph replay at a captured token
    # count, or eager (graphs off, too many tokens or sequences); padded tokens of the replays; their memory.
    prefill_steps_graph: int = 0
    prefill_steps_eager: int = 0
    prefill_padded_tokens: int = 0
    prefill_graph_sizes: tuple[int, ...] = ()
    prefill_graph_memory_bytes: int = 0
    # Mixed steps whose decode rows rode in the chunks' prefill-graph replay (--mixed-step one-replay): decode
    # steps too, counted here and not in decode_steps_graph / decode_steps_eager.
    decode_steps_mixed: int = 0
    # --batch-invariant: the kernels reduce each row in an order that row alone sets (/health and /metrics show it).
    batch_invariant: bool = False
    # The weights as loaded: bytes on the device (one rank's) and their scheme (config.quantization_label).
    weights_bytes: int = 0
    quantization: str = "none"
    # The KV pool's element type as torch names it (bfloat16, float8_e4m3fn: --kv-cache-dtype) and its block size.
    kv_cache_dtype: str = ""
    kv_block_size: int = 0
    # Speculative decoding (--speculative-method): verify rows that carried proposals, tokens proposed, proposed
    # tokens accepted (vLLM's spec_decode counters). Acceptance rate = accepted / proposed; mean accepted length
    # (tokens a row gained per verify step, the bonus token included) = 1 + accepted / rows.
    spec_decode_drafts: int = 0
    spec_decode_draft_tokens: int = 0
    spec_decode_accepted_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float | None:
        return self.spec_decode_accepted_tokens / self.spec_decode_draft_tokens if self.spec_decode_draft_tokens \
            else None

    @property
    def spec_mean_accepted_length(self) -> float | None:
        return 1 + self.spec_decode_accepted_tokens / self.spec_decode_drafts if self.spec_decode_drafts else None
