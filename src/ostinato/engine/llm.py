"""The offline API: `LLM(model, **engine_args).generate(prompts, sampling_params)` and `.chat(messages)`."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ostinato.config import EngineArgs
from ostinato.errors import ConfigError, InvalidRequestError
from ostinato.sampling_params import RequestOutputKind, SamplingParams, with_defaults
from ostinato.engine.chat_prompt import render_chat
from ostinato.engine.engine import LLMEngine
from ostinato.engine.outputs import RequestOutput


class LLM:
    """Loads a model (HF folder, GGUF file or short name, e.g. "smollm2-135m") and generates for batches of
    prompts or conversations with continuous batching.

    engine_args are EngineArgs fields (dtype, max_model_len, max_num_seqs, enforce_eager, ...), with the server's
    defaults but one: unless given, max_prefill_tokens_while_decoding is the whole step budget (no cap), where the
    server caps it (step_policy.py says why).
    """

    def __init__(self, model: str, **engine_args):
        unknown = set(engine_args) - EngineArgs.field_names()
        if unknown:
            raise ConfigError(f"unknown engine argument(s) {sorted(unknown)}; "
                              f"valid: {sorted(EngineArgs.field_names())}")
        self.engine = LLMEngine(_offline(EngineArgs(model=model, **engine_args)))
        self._next_id = 0

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLM":
        llm = cls.__new__(cls)
        llm.engine, llm._next_id = LLMEngine(_offline(args)), 0
        return llm

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate and chat use without sampling_params: the model's defaults (--generation-config), as
        in vLLM. A SamplingParams passed in is used as it is."""
        return with_defaults({}, self.engine.generation_defaults)

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One output per prompt, in the order given, each complete. A prompt is a string or a list of token ids.

        Requests run as RequestOutputKind.FINAL_ONLY whatever their output_kind says: the engine hands back
        nothing per step and builds each output once, when its request finishes.
        """
        if not isinstance(prompts, (str, Sequence)):
            raise InvalidRequestError(f"prompts must be a prompt (a string or a list of token ids) or a list of "
                                      f"prompts, got {type(prompts).__name__}", param="prompts")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        params = [p if p.output_kind is RequestOutputKind.FINAL_ONLY
                  else p.replace(output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        if len(params) != len(prompts):
            raise InvalidRequestError(f"got {len(prompts)} prompts but {len(params)} sampling params; pass one "
                                      "SamplingParams or one per prompt", param="sampling_params")
        for p in {p.structured_outputs for p in params} - {None}:
            self.engine.constrained.check(p)  # compiled here (bounded), so a bad schema raises before any is queued
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                rid = f"gen-{self._next_id}"
                self._next_id += 1
                self.engine.add_request(rid, prompt, p)
                ids.append(rid)
            return self._run_to_completion(ids, use_tqdm)
        except BaseException:
            # Whatever stops the batch (a bad prompt, an error inside a step, Ctrl-C) aborts all of it: requests
            # left in the engine would hold KV blocks and hand their outputs to the next generate.
            for rid in ids:
                self.engine.abort(rid)
            raise

    def stream(self, prompt: str | Sequence[int],
               sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """One prompt's output while it is generated: DELTA outputs (the text and token ids new since the
        previous one), the last with finished=True; merge_deltas joins them into what generate returns.

        Leaving the loop early (break, an exception, Ctrl-C) aborts the request when the iterator is closed,
        so that it frees its KV blocks and leaves nothing for the next call."""
        params = (sampling_params or SamplingParams()).replace(output_kind=RequestOutputKind.DELTA)
        rid = f"gen-{self._next_id}"
        self._next_id += 1
        self.engine.add_request(rid, prompt, params)
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id == rid:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.engine.abort(rid)

    def _run_to_completion(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step the engine until every request of `ids` has finished; their outputs in the order of `ids`."""
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        try:
            while len(results) < len(ids):
                for out in self.engine.step():  # FINAL_ONLY: every output is a finished request
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [results[rid] for rid in ids]

    def chat(self, messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = False,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: Mapping[str, Any] | None = None) -> list[RequestOutput]:
        """Like vLLM's LLM.chat: one conversation (a list of {"role", "content"} dicts) or a batch of them,
        each rendered by the model's chat template (or `chat_template`) and generated like a prompt.
        One output per conversation, in order; its `prompt` is the rendered text."""
        if not messages:
            raise InvalidRequestError("messages is empty; pass a conversation or a list of them", param="messages")
        batch = [messages] if isinstance(messages[0], Mapping) else list(messages)
        rendered = [render_chat(self.tokenizer, conv, chat_template=chat_template,
                                add_generation_prompt=add_generation_prompt,
                                continue_final_message=continue_final_message,
                                chat_template_kwargs=chat_template_kwargs) for conv in batch]
        outs = self.generate([ids for _, ids in rendered], sampling_params, use_tqdm=use_tqdm)
        for out, (text, _) in zip(outs, rendered):
            out.prompt = text
        return outs


def _offline(args: EngineArgs) -> EngineArgs:
    """The offline API's step policy where the caller left it unset: a step that decodes may carry as many prompt
    tokens as the budget leaves (step_policy.py)."""
    if args.max_prefill_tokens_while_decoding is not None:
        return args
    return replace(args, max_prefill_tokens_while_decoding=args.step_budget())
