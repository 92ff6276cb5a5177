"""LLMEngine: the step-wise engine the offline API and the server share.

add_request() validates at the edge and queues; step() runs one scheduler step through the model runner and
returns what changed; abort() frees a request's blocks at once. Not thread-safe: drive it from one thread
(engine/async_engine.py does that for the server).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ostinato.config import EngineArgs, EngineConfig, ModelConfig
from ostinato.contract import StepResult
from ostinato.errors import InvalidRequestError, QueueFullError
from ostinato.model.gguf_sources import resolve_model_dir
from ostinato.model.hub import check_tokenizer_folder
from ostinato.sampling_params import RequestOutputKind, SamplingParams
from ostinato.engine.detokenizer import IncrementalDetokenizer, OutputText
from ostinato.engine.outputs import CompletionOutput, EngineStats, RequestOutput, TokenLogprob
from ostinato.engine.request import Sequence, SequenceStatus
from ostinato.engine.scheduler import Scheduler

if TYPE_CHECKING:
    from ostinato.runner.protocol import Runner

logger = logging.getLogger(__name__)


@dataclass
class _SeqState:
    """Engine-side bookkeeping of one sequence: its text and logprobs, and how much of them the request's
    DELTA outputs have handed out already."""

    seq: Sequence
    index: int
    detok: IncrementalDetokenizer
    text: OutputText  # released text, cut at a stop string once one is found
    stop_ids: frozenset[int]  # token ids that end it: EOS (unless ignore_eos) and stop_token_ids
    max_output: int  # output tokens at which it ends ("length"): max_tokens, or what max_model_len leaves
    # Its text is needed before it finishes (a stream, or stop strings to look for); else it is decoded once,
    # when the sequence finishes, and a step only records its token.
    text_per_step: bool
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    sent_tokens: int = 0  # DELTA: output tokens (and logprobs) already in an output
    sent_pieces: int = 0  # DELTA: pieces of text.pieces already in an output
    sent_finish: bool = False  # DELTA: the finish reason went out


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seqs: list[_SeqState] = field(default_factory=list)
    first_token_time: float | None = None
    finished_time: float | None = None
    num_unfinished: int = 0  # sequences without a finish reason (LLMEngine._finish counts them down)

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    check_tokenizer_folder(path)  # a folder without one: a CheckpointError naming the files, not a traceback

    return AutoTokenizer.from_pretrained(str(path))


def eos_token_ids(model_dir: str | Path, model_config: ModelConfig, tokenizer) -> frozenset[int]:
    """EOS ids from config.json, generation_config.json and the tokenizer: any of them ends a sequence."""
    ids = set(model_config.eos_token_ids)
    gen_cfg = Path(model_dir) / "generation_config.json"
    if gen_cfg.is_file():
        import json

        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def resolve_engine_config(args: EngineArgs) -> EngineConfig:
    """args.resolve() on what only the layers below know: the HF folder args.model names (a GGUF file or short
    name, e.g. smollm2-135m, gives its metadata folder, or with --gguf-dequantize a cached float32 folder) and
    the device --device auto picks."""
    from ostinato.runner.runner import pick_device  # torch lives below this line of the dependency graph

    model_dir = resolve_model_dir(args.model, args.revision, args.gguf_dequantize)
    return args.resolve(model_dir, pick_device(args.device).type)


class LLMEngine:
    def __init__(self, config: EngineArgs | EngineConfig):
        from ostinato.runner.tp_executor import make_runner

        if isinstance(config, EngineArgs):
            config = resolve_engine_config(config)
        self.config = config
        self.model_dir = Path(config.model_dir)
        self.model_config = config.model
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.scheduler_config = config.scheduler
        self.served_model_name = config.served_model_name
        self.eos_ids = eos_token_ids(self.model_dir, self.model_config, self.tokenizer)
        # A TensorParallelRunner with --tensor-parallel-size > 1.
        self.runner: Runner = make_runner(config.runner, config.parallel)
        # The prefix cache's salt names what else changes a block's K/V: the model's weights and the dtype.
        cache_config = replace(self.runner.cache_config, enable_prefix_caching=config.enable_prefix_caching,
                               prefix_cache_salt=f"{self.model_dir}|{self.runner.dtype}")
        self.scheduler = Scheduler(self.scheduler_config, cache_config)
        self._requests: dict[str, _RequestState] = {}
        self._seq_owner: dict[int, tuple[_RequestState, _SeqState]] = {}
        self._seq_ids = itertools.count()
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._inflight = None  # the launched decode step whose tokens are not read yet (async_scheduling)

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> list[int]:
        """Validate and queue a request; returns the prompt's token ids."""
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        prompt_text, prompt_ids = self._tokenize(prompt)
        self._validate_lengths(prompt_ids, params)
        self._check_stop_token_ids(params.stop_token_ids)
        limit = self.scheduler_config.max_queued_requests
        if limit is not None and params.n > limit:  # no retry could ever queue it: 400, not 429
            raise InvalidRequestError(f"n ({params.n}) exceeds the waiting queue's bound --max-queued-requests "
                                      f"{limit}, so the request could never be queued whole: lower n", param="n")
        if limit is not None and self.scheduler.num_waiting + params.n > limit:
            # Checked up front so that a request with n > 1 is queued whole or not at all.
            raise QueueFullError(f"the waiting queue is full ({self.scheduler.num_waiting} of {limit}); "
                                 "retry later or raise --max-queued-requests")
        state = _RequestState(request_id, prompt_text, prompt_ids, params, arrival_time or time.monotonic())
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        max_output = min(params.max_tokens, self.scheduler_config.max_model_len - len(prompt_ids))
        text_per_step = bool(params.stop) or params.output_kind is not RequestOutputKind.FINAL_ONLY
        for index in range(params.n):
            seq = Sequence(next(self._seq_ids), request_id, list(prompt_ids), self._child_params(params, index))
            self.scheduler.add(seq)  # may raise QueueFullError / InvalidRequestError
            st = _SeqState(seq, index, IncrementalDetokenizer(self.tokenizer, prompt_ids,
                                                              params.skip_special_tokens),
                           OutputText(params.stop, params.include_stop_str_in_output), stop_ids, max_output,
                           text_per_step, logprobs=[] if params.logprobs is not None else None)
            state.seqs.append(st)
            state.num_unfinished += 1
            self._seq_owner[seq.seq_id] = (state, st)
        self._requests[request_id] = state
        return prompt_ids

    @staticmethod
    def _child_params(params: SamplingParams, index: int) -> SamplingParams:
        # n > 1 with a seed: each completion gets its own reproducible stream (seed + index).
        if params.n == 1 or params.seed is None:
            return params
        return params.replace(seed=params.seed + index, n=1)

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if prompt == "":  # checked before encoding: a tokenizer that adds BOS would make it non-empty
                raise InvalidRequestError("the prompt is empty; send at least one token", param="prompt")
            if not prompt.isascii():
                try:  # a lone surrogate makes the tokenizer raise a TypeError that says nothing useful
                    prompt.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise InvalidRequestError(f"the prompt contains a lone UTF-16 surrogate at character {e.start}; "
                                              "send valid Unicode text", param="prompt") from None
            return prompt, self.tokenizer.encode(prompt)
        try:
            ids = list(prompt)
        except TypeError:  # None, a number: say what a prompt is rather than that it is not iterable
            raise InvalidRequestError(f"a prompt must be a string or a list of token ids, got "
                                      f"{type(prompt).__name__}", param="prompt") from None
        self.scheduler.check_prompt_len(len(ids))  # before the scan below, which is as long as the list
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token ids must be integers in [0, {vocab}); got {bad[:5]}", param="prompt")
        return None, ids

    def _check_stop_token_ids(self, stop_token_ids: tuple[int, ...]) -> None:
        # SamplingParams knows they are non-negative integers; only the model knows its vocabulary. An id past
        # it could never be sampled, so the request would silently run on to max_tokens.
        vocab = self.model_config.vocab_size
        bad = [t for t in stop_token_ids if t >= vocab]
        if bad:
            raise InvalidRequestError(f"stop_token_ids must be token ids in [0, {vocab}) (the model's vocabulary); "
                                      f"got {bad[:5]}", param="stop_token_ids")

    def _validate_lengths(self, prompt_ids: list[int], params: SamplingParams) -> None:
        # The scheduler's rule (non-empty, shorter than max_model_len) first, before any sequence is queued.
        self.scheduler.check_prompt_len(len(prompt_ids))
        max_len = self.scheduler_config.max_model_len
        if len(prompt_ids) + params.max_tokens > max_len:
            raise InvalidRequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len "
                f"{max_len}: lower max_tokens to at most {max_len - len(prompt_ids)}", param="max_tokens")

    def abort(self, request_id: str) -> None:
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        for st in state.seqs:
            self.scheduler.abort(st.seq.seq_id)
            self._seq_owner.pop(st.seq.seq_id, None)

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker ranks, if any (also done at interpreter exit)."""
        self.runner.shutdown()

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler step. With async_scheduling a decode step is launched and the tokens of the decode
        step before it are read and returned instead: the CPU prepares step n+1 while the GPU runs step n."""
        out = self.scheduler.schedule()
        if out.is_empty and not out.left and self._inflight is None:
            return []
        pending = self.runner.launch(out)  # an idle step only drops the rows of sequences that left
        if out.num_decode and self.config.async_scheduling:  # a mixed step's chunks' tokens wait with the rows'
            ready = [self._inflight] if self._inflight is not None else []
            self._inflight = pending
        else:  # a prefill-only (or idle) step reads what is in flight too: the next step starts from settled tokens
            ready = [p for p in (self._inflight, pending) if p is not None]
            self._inflight = None
        now = time.monotonic()
        touched: dict[str, _RequestState] = {}  # requests that may have an output this step
        for p in ready:
            result = p.result()  # waits for that step's tokens
            self.scheduler.update(result.seq_ids, result.token_ids)
            self._take_tokens(result, now, touched)
        outputs = []
        for state in touched.values():
            if state.finished:
                state.finished_time = now
                self._requests.pop(state.request_id, None)
                for st in state.seqs:
                    self._seq_owner.pop(st.seq.seq_id, None)
            output = self._make_output(state)
            if output is not None:
                outputs.append(output)
        return outputs

    def _take_tokens(self, result: StepResult, now: float, touched: dict[str, _RequestState]) -> None:
        """Take one step's sampled tokens. The loop runs once per running sequence per step, so what a
        sequence needs no text for until it ends (LLM.generate's FINAL_ONLY requests without stop strings or
        logprobs) costs two checks here: a stop token, or its length."""
        owners, taken = self._seq_owner, 0
        for seq_id, token_id, tok in zip(result.seq_ids, result.token_ids, result.tokens):
            owner = owners.get(seq_id)
            if owner is None or owner[1].finish_reason is not None:
                continue  # finished (or aborted) at the step before: a wasted row, never an extra token
            state, st = owner
            taken += 1
            if state.first_token_time is None:
                # Its prefill ran: the prompt counts now, once per request as in vLLM (not when queued,
                # and not again when a preempted sequence is recomputed; num_preemptions counts those).
                state.first_token_time = now
                self._prompt_tokens_total += len(state.prompt_token_ids)
            if st.text_per_step or st.logprobs is not None:
                self._process_token(state, st, tok)
                touched[state.request_id] = state
            elif token_id in st.stop_ids:
                self._finish(state, st, "stop")
                touched[state.request_id] = state
            elif len(st.seq.output_token_ids) >= st.max_output:
                self._finish(state, st, "length")
                touched[state.request_id] = state
        self._generation_tokens_total += taken

    def _process_token(self, state: _RequestState, st: _SeqState, tok) -> None:
        """Take one sampled token: detokenize it, look for stop strings, decide whether the sequence ends.
        O(1) in the sequence's length."""
        if st.logprobs is not None:
            top = (tok.top or [])[: st.seq.sampling_params.logprobs]
            st.logprobs.append(TokenLogprob(tok.token_id, tok.logprob, top))
        if st.text_per_step and st.text.append(st.detok.append(tok.token_id)):
            self._finish(state, st, "stop")  # a stop string
        elif tok.token_id in st.stop_ids:
            self._finish(state, st, "stop")
        elif len(st.seq.output_token_ids) >= st.max_output:
            self._finish(state, st, "length")

    def _finish(self, state: _RequestState, st: _SeqState, reason: str) -> None:
        st.finish_reason = reason
        state.num_unfinished -= 1
        if not st.text_per_step:  # its text, decoded once
            st.text.append(st.detok.decode_all(st.seq.output_token_ids))
        st.text.finish()
        status = SequenceStatus.FINISHED_STOPPED if reason == "stop" else SequenceStatus.FINISHED_LENGTH
        self.scheduler.finish(st.seq.seq_id, status)

    def _make_output(self, state: _RequestState) -> RequestOutput | None:
        """The request's output for this step, as its output_kind asks; None when there is nothing to send."""
        kind = state.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not state.finished:
            return None
        if kind is RequestOutputKind.DELTA:
            if len(state.seqs) == 1:
                delta = self._delta(state.seqs[0])
                comps = [] if delta is None else [delta]
            else:
                comps = [c for c in map(self._delta, state.seqs) if c is not None]
        else:
            comps = [self._whole(st) for st in state.seqs]
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, comps, state.finished,
                             state.arrival_time, state.first_token_time, state.finished_time,
                             state.seqs[0].seq.num_cached_tokens or 0)

    @staticmethod
    def _whole(st: _SeqState) -> CompletionOutput:
        """Everything so far: O(length), so built every step only for CUMULATIVE requests."""
        return CompletionOutput(st.index, st.text.text, list(st.seq.output_token_ids), st.finish_reason,
                                list(st.logprobs) if st.logprobs is not None else None)

    @staticmethod
    def _delta(st: _SeqState) -> CompletionOutput | None:
        """What is new since this sequence's last delta (O(new tokens)); None if nothing is."""
        tokens, pieces = st.seq.output_token_ids, st.text.pieces
        if st.sent_tokens == len(tokens) and (st.finish_reason is None or st.sent_finish):
            return None
        out = CompletionOutput(st.index, "".join(pieces[st.sent_pieces:]), tokens[st.sent_tokens:],
                               st.finish_reason,
                               st.logprobs[st.sent_tokens:] if st.logprobs is not None else None)
        st.sent_tokens, st.sent_pieces = len(tokens), len(pieces)
        st.sent_finish = st.finish_reason is not None
        return out

    # ---- introspection -----------------------------------------------------------------------------
    @property
    def graph_status(self) -> str:
        return self.runner.graph_status

    def stats(self) -> EngineStats:
        g = self.runner.graph_stats()
        pg = self.runner.prefill_graph_stats()
        bm = self.scheduler.block_manager
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_blocks_total=self.runner.cache_config.num_blocks,
            kv_blocks_free=bm.num_free_blocks,
            kv_usage=bm.usage,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            decode_steps_graph=g.graph_steps,
            decode_steps_eager=g.eager_steps,
            padded_rows=g.padded_rows,
            replays_by_size=dict(g.replays_by_size),
            captured_sizes=tuple(self.runner.captured_sizes),
            graph_memory_bytes=self.runner.graph_memory_bytes,
            graph_capture_seconds=self.runner.graph_capture_seconds,
            graphs_enabled=self.runner.graphs_enabled,
            graph_disabled_cause=self.runner.graph_disabled_cause,
            decode_batch_sizes=dict(g.steps_by_batch),
            max_num_seqs=self.scheduler_config.max_num_seqs,
            ranks=tuple(self.runner.rank_health()),
            prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            kernel_compiles_in_service=self.runner.compile_watch.compiles_in_service,
            prefill_steps_graph=pg.graph_steps, prefill_steps_eager=pg.eager_steps,
            prefill_padded_tokens=pg.padded_tokens, prefill_graph_sizes=pg.captured_sizes,
            prefill_graph_memory_bytes=self.runner.prefill_graph_memory_bytes, decode_steps_mixed=pg.mixed_steps,
        )
