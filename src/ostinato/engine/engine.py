"""LLMEngine: the step-wise engine the offline API and the server share.

add_request() validates at the edge and queues; step() runs one scheduler step through the model runner and
returns what changed; abort() frees a request's blocks at once. Not thread-safe: drive it from one thread.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ostinato.config import EngineArgs, EngineConfig, quantization_label
from ostinato.contract import StepResult
from ostinato.errors import InvalidRequestError, QueueFullError
from ostinato.sampling_params import RequestOutputKind, SamplingParams
from ostinato.engine.logits_spec import resolve_logits_spec
from ostinato.engine.grammar import ConstrainedRequests
from ostinato.engine.model_files import eos_token_ids, load_tokenizer, resolve_engine_config  # noqa: F401
from ostinato.engine.detokenizer import IncrementalDetokenizer, OutputText
from ostinato.engine.outputs import EngineStats, OutputRecord, RequestOutput, TokenLogprob, output_from_record
from ostinato.engine.request import Sequence, SequenceStatus
from ostinato.engine.scheduler import Scheduler
from ostinato.engine.speculative import SpecTotals, check_request, make_scheduler, split_rounds
from ostinato.engine.step_outputs import request_record
from ostinato.engine.token_texts import TokenTextCache
from ostinato.engine.request_state import RequestState, SeqState

if TYPE_CHECKING:
    from ostinato.runner.protocol import Runner

logger = logging.getLogger(__name__)


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
        self.generation_defaults = dict(config.generation_defaults)  # what unset request fields take
        sched = self.scheduler_config
        logger.info("steps: up to %d sequences, %d tokens a step; a step that also decodes carries at most %d "
                    "prompt tokens (--max-num-seqs, --max-num-batched-tokens, --max-prefill-tokens-while-decoding)",
                    sched.max_num_seqs, sched.max_num_batched_tokens,
                    sched.max_prefill_tokens_while_decoding or sched.max_num_batched_tokens)
        if self.generation_defaults:
            logger.info("sampling defaults from %s: %s (a request's own values win; --generation-config vllm "
                        "ignores the file)", config.generation_defaults_source,
                        ", ".join(f"{k}={v}" for k, v in sorted(self.generation_defaults.items())))
        self._token_texts = TokenTextCache(self.tokenizer)
        self.runner: Runner = make_runner(config.runner, config.parallel)
        # The prefix cache's salt names what else changes a block's K/V: the model's weights and the dtype.
        cache_config = replace(self.runner.cache_config, enable_prefix_caching=config.enable_prefix_caching,
                               prefix_cache_salt=f"{self.model_dir}|{self.runner.dtype}")
        self.speculative = config.speculative
        self.scheduler: Scheduler = make_scheduler(self.scheduler_config, cache_config, self.speculative)
        self.spec_totals = SpecTotals()
        self._requests: dict[str, RequestState] = {}
        self._seq_owner: dict[int, tuple[RequestState, SeqState]] = {}
        self._seq_ids = itertools.count()
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._inflight = None  # the launched decode step whose tokens are not read yet (async_scheduling)
        self._settled = None  # the in-flight step once its tokens were taken early (to fill grammar masks)
        self._touched: dict[str, RequestState] = {}  # requests that may have an output this step
        self.constrained = ConstrainedRequests(self.tokenizer, self.model_config.vocab_size, self.eos_ids,
                                               config.parallel.tensor_parallel_size)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> list[int]:
        """Validate and queue a request; returns the prompt's token ids."""
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        prompt_text, prompt_ids = self._tokenize(prompt)
        self._validate_lengths(prompt_ids, params)
        self._check_stop_token_ids(params.stop_token_ids)
        if self.speculative is not None:
            check_request(params)
        limit = self.scheduler_config.max_queued_requests
        if limit is not None and params.n > limit:  # no retry could ever queue it: 400, not 429
            raise InvalidRequestError(f"n ({params.n}) exceeds the waiting queue's bound --max-queued-requests "
                                      f"{limit}, so the request could never be queued whole: lower n", param="n")
        if limit is not None and self.scheduler.num_waiting + self.constrained.num_held_seqs + params.n > limit:
            # Checked up front so that a request with n > 1 is queued whole or not at all.
            raise QueueFullError(f"the waiting queue is full ({self.scheduler.num_waiting} of {limit}); "
                                 "retry later or raise --max-queued-requests")
        state = RequestState(request_id, prompt_text, prompt_ids, params, arrival_time or time.monotonic())
        spec = params.structured_outputs
        compiled = None if spec is None else self.constrained.submit(request_id, spec, params.n)
        if spec is None or compiled is not None:
            self._queue(state, compiled)
        else:  # held outside the scheduler while its grammar compiles (ConstrainedRequests.take_ready)
            self._requests[request_id] = state
        return prompt_ids

    def _queue(self, state: RequestState, compiled) -> None:
        """A validated request's sequences into the scheduler (with their grammar's matchers when constrained)."""
        request_id, params, prompt_ids = state.request_id, state.params, state.prompt_token_ids
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        logits_spec = resolve_logits_spec(params, stop_ids, self.tokenizer, self.model_config.vocab_size)
        max_output = min(params.max_tokens, self.scheduler_config.max_model_len - len(prompt_ids))
        text_per_step = bool(params.stop) or params.output_kind is not RequestOutputKind.FINAL_ONLY
        texts = (self._token_texts.get(params.skip_special_tokens)
                 if text_per_step and not params.stop and params.logprobs is None else None)
        for index in range(params.n):
            child = self._child_params(params, index)
            seq = Sequence(next(self._seq_ids), request_id, list(prompt_ids), child,
                           logits_spec=replace(logits_spec, params=child) if logits_spec is not None else None)
            self.scheduler.add(seq)  # may raise QueueFullError / InvalidRequestError
            st = SeqState(seq, index, IncrementalDetokenizer(self.tokenizer, prompt_ids,
                                                              params.skip_special_tokens),
                           OutputText(params.stop, params.include_stop_str_in_output), stop_ids, max_output,
                           text_per_step, compiled is not None,
                           logprobs=[] if params.logprobs is not None else None, texts=texts)
            st.on_table = texts is not None and st.detok.at_boundary
            if compiled is not None:
                self.constrained.rows.add(seq.seq_id, compiled)
            state.seqs.append(st)
            state.num_unfinished += 1
            self._seq_owner[seq.seq_id] = (state, st)
        self._requests[request_id] = state

    def _admit_compiled(self) -> list[tuple[RequestState, OutputRecord]]:
        """Queue the held requests whose grammar compiled; those whose compile failed end without tokens."""
        ended = []
        for request_id, compiled in self.constrained.take_ready():
            state = self._requests.get(request_id)  # None: aborted meanwhile
            if state is not None and not isinstance(compiled, InvalidRequestError):
                self._queue(state, compiled)
            elif state is not None:
                logger.warning("request %s ends unserved: %s", request_id, compiled)
                del self._requests[request_id]
                comps = [(i, "", [], "abort", None) for i in range(state.params.n)]
                ended.append((state, (request_id, comps, True, None, time.monotonic(), 0)))
        return ended

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
        self.constrained.drop(request_id)
        for st in state.seqs:
            self.scheduler.abort(st.seq.seq_id)
            self._seq_owner.pop(st.seq.seq_id, None)
            self.constrained.rows.remove(st.seq.seq_id)

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker ranks, if any (also done at interpreter exit)."""
        self.runner.shutdown()

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler step. With async_scheduling a decode step is launched and the tokens of the decode
        step before it are read and returned instead: the CPU prepares step n+1 while the GPU runs step n."""
        early, states = self._step()
        done = early + [(s, r) for s in states if (r := request_record(s)) is not None]
        return [output_from_record(r, s.prompt, s.prompt_token_ids, s.arrival_time) for s, r in done]

    def step_records(self) -> list[OutputRecord]:
        """step(), each output as the plain tuple the server's core sends (engine/step_outputs.py)."""
        early, states = self._step()
        return [r for _, r in early] + [r for r in map(request_record, states) if r is not None]

    def _step(self) -> tuple[list[tuple[RequestState, OutputRecord]], list[RequestState]]:
        """One scheduler step: held requests that ended unserved (with their records), and those it touched."""
        early = self._admit_compiled() if self.constrained.num_held_seqs else []
        out = self.scheduler.schedule()
        if out.is_empty and not out.left and self._inflight is None:
            self.constrained.wait_for_held(0.005)  # nothing else to run: no busy loop while grammars compile
            return early, []
        self._touched = touched = {}
        if self.constrained.rows:  # the runner asks for the constrained rows' masks once the forward runs
            pending = self.runner.launch(out, self._grammar_masks)
        else:
            pending = self.runner.launch(out)  # an idle step only drops the rows of sequences that left
        if out.num_decode and self.config.async_scheduling:  # a mixed step's chunks' tokens wait with the rows'
            ready = [self._inflight] if self._inflight is not None else []
            self._inflight = pending
        else:  # a prefill-only (or idle) step reads what is in flight too: the next step starts from settled tokens
            ready = [p for p in (self._inflight, pending) if p is not None]
            self._inflight = None
        now = time.monotonic()
        for p in ready:
            self._settle(p, now)
        for state in touched.values():
            if state.finished:
                state.finished_time = now
                self._requests.pop(state.request_id, None)
                for st in state.seqs:
                    self._seq_owner.pop(st.seq.seq_id, None)
        return early, list(touched.values())

    def _settle(self, pending, now: float) -> None:
        """Take a launched step's tokens, once (the grammar masks may have taken the in-flight step's early)."""
        if pending is not self._settled:
            self._settled, result = pending, pending.result()  # waits for that step's tokens
            if result.spec is None:
                self.scheduler.update(result.seq_ids, result.token_ids)
                self._take_tokens(result, now, self._touched)
                return
            self.spec_totals.add(result.spec)
            for round_ in split_rounds(result):  # a verify step: a sequence may end inside its accepted run
                self.scheduler.update(round_.seq_ids, round_.token_ids)
                self._take_tokens(round_, now, self._touched)

    def _grammar_masks(self, seq_ids: list[int]):
        """The runner's call, while a step's forward runs: the next-token bitmasks of its constrained rows. They
        wait for the in-flight step's tokens (the matchers must have accepted them), taken here."""
        if self._inflight is not None:
            self._settle(self._inflight, time.monotonic())
        return self.constrained.rows.fill(seq_ids)

    def _take_tokens(self, result: StepResult, now: float, touched: dict[str, RequestState]) -> None:
        """Take one step's sampled tokens. The loop runs once per running sequence per step, so what a
        sequence needs no text for until it ends (LLM.generate's FINAL_ONLY requests without stop strings or
        logprobs) costs two checks here: a stop token, or its length."""
        owners, taken = self._seq_owner, 0
        # The constrained sequences' matchers advance first, in one call for the whole step: the ids of those the
        # token ends (grammar complete, or the token refused). A finished sequence's matcher is gone already.
        grammar_ended = self.constrained.rows.accept_tokens(result.seq_ids, result.token_ids) \
            if self.constrained.rows else ()
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
            ended = seq_id in grammar_ended
            if st.on_table and (text := st.texts[token_id]) is not None:  # a streamed token's text, looked up
                if text:
                    st.text.pieces.append(text)
                if ended or token_id in st.stop_ids:
                    self._finish(state, st, "stop")
                elif len(st.seq.output_token_ids) >= st.max_output:
                    self._finish(state, st, "length")
                touched[state.request_id] = state
            elif st.text_per_step or st.logprobs is not None:
                self._process_token(state, st, tok, ended)
                touched[state.request_id] = state
            elif ended or token_id in st.stop_ids:
                self._finish(state, st, "stop")
                touched[state.request_id] = state
            elif len(st.seq.output_token_ids) >= st.max_output:
                self._finish(state, st, "length")
                touched[state.request_id] = state
        self._generation_tokens_total += taken

    def _process_token(self, state: RequestState, st: SeqState, tok, ended: bool = False) -> None:
        """Take one sampled token: detokenize it, look for stop strings, decide whether the sequence ends.
        O(1) in the sequence's length."""
        if st.logprobs is not None:
            top = (tok.top or [])[: st.seq.sampling_params.logprobs]
            st.logprobs.append(TokenLogprob(tok.token_id, tok.logprob, top))
        if st.on_table:  # part of a character: the detokenizer holds it, with the tokens before as context
            st.on_table = False
            n = st.seq.num_tokens
            st.detok = IncrementalDetokenizer(self.tokenizer, st.seq.token_ids_range(max(0, n - 25), n - 1),
                                              st.seq.sampling_params.skip_special_tokens)
        if st.text_per_step and st.text.append(st.detok.append(tok.token_id)):
            self._finish(state, st, "stop")  # a stop string
        elif ended or tok.token_id in st.stop_ids:
            self._finish(state, st, "stop")
        elif len(st.seq.output_token_ids) >= st.max_output:
            self._finish(state, st, "length")
        st.on_table = st.texts is not None and st.detok.at_boundary

    def _finish(self, state: RequestState, st: SeqState, reason: str) -> None:
        if st.constrained:
            self.constrained.rows.remove(st.seq.seq_id)
        st.finish_reason = reason
        state.num_unfinished -= 1
        if not st.text_per_step:  # its text, decoded once
            st.text.append(st.detok.decode_all(st.seq.output_token_ids))
        st.text.finish()
        status = SequenceStatus.FINISHED_STOPPED if reason == "stop" else SequenceStatus.FINISHED_LENGTH
        self.scheduler.finish(st.seq.seq_id, status)

    @property
    def graph_status(self) -> str:
        return self.runner.graph_status

    def stats(self) -> EngineStats:
        g = self.runner.graph_stats()
        pg = self.runner.prefill_graph_stats()
        bm = self.scheduler.block_manager
        return EngineStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            kv_blocks_total=self.runner.cache_config.num_blocks, kv_blocks_free=bm.num_free_blocks,
            kv_usage=bm.usage, num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self._prompt_tokens_total, generation_tokens_total=self._generation_tokens_total,
            decode_steps_graph=g.graph_steps, decode_steps_eager=g.eager_steps, padded_rows=g.padded_rows,
            replays_by_size=dict(g.replays_by_size), captured_sizes=tuple(self.runner.captured_sizes),
            graph_memory_bytes=self.runner.graph_memory_bytes,
            graph_capture_seconds=self.runner.graph_capture_seconds, graphs_enabled=self.runner.graphs_enabled,
            graph_disabled_cause=self.runner.graph_disabled_cause, decode_batch_sizes=dict(g.steps_by_batch),
            max_num_seqs=self.scheduler_config.max_num_seqs, ranks=tuple(self.runner.rank_health()),
            prefix_cache_queries=bm.prefix_queries, prefix_cache_hits=bm.prefix_hits,
            kernel_compiles_in_service=self.runner.compile_watch.compiles_in_service,
            prefill_steps_graph=pg.graph_steps, prefill_steps_eager=pg.eager_steps,
            prefill_padded_tokens=pg.padded_tokens, prefill_graph_sizes=pg.captured_sizes,
            prefill_graph_memory_bytes=self.runner.prefill_graph_memory_bytes, decode_steps_mixed=pg.mixed_steps,
            batch_invariant=self.config.runner.batch_invariant, **self.spec_totals.stats(),
            weights_bytes=getattr(self.runner, "weights_bytes", 0),
            quantization=quantization_label(self.model_config.quantization),
            kv_cache_dtype=str(self.runner.kv_dtype).removeprefix("torch."), kv_block_size=self.runner.block_size,
        )
