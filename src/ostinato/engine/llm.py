"""The offline API: `LLM(model_dir, **engine_args).generate(prompts, sampling_params)`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ..config import EngineArgs
from ..errors import ConfigError, InvalidRequestError
from ..sampling_params import RequestOutputKind, SamplingParams
from .engine import LLMEngine
from .outputs import RequestOutput


class LLM:
    """Loads a model folder and generates for a batch of prompts with continuous batching.

    engine_args are EngineArgs fields (dtype, max_model_len, max_num_seqs, enforce_eager, ...).
    """

    def __init__(self, model: str, **engine_args):
        unknown = set(engine_args) - EngineArgs.field_names()
        if unknown:
            raise ConfigError(f"unknown engine argument(s) {sorted(unknown)}; valid: {sorted(EngineArgs.field_names())}")
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))
        self._next_id = 0

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLM":
        llm = cls.__new__(cls)
        llm.engine, llm._next_id = LLMEngine(args), 0
        return llm

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One output per prompt, in the order given, each complete. A prompt is a string or a list of token ids.

        Requests run as RequestOutputKind.FINAL_ONLY whatever their output_kind says: the engine hands back
        nothing per step and builds each output once, when its request finishes.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        params = [p if p.output_kind is RequestOutputKind.FINAL_ONLY
                  else replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        if len(params) != len(prompts):
            raise InvalidRequestError(f"got {len(prompts)} prompts but {len(params)} sampling params; pass one "
                                      "SamplingParams or one per prompt", param="sampling_params")
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                rid = f"gen-{self._next_id}"
                self._next_id += 1
                self.engine.add_request(rid, prompt, p)
                ids.append(rid)
        except Exception:
            for rid in ids:  # leave the engine clean: no half-submitted batch
                self.engine.abort(rid)
            raise
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        while len(results) < len(ids):
            for out in self.engine.step():  # FINAL_ONLY: every output is a finished request
                results[out.request_id] = out
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return [results[rid] for rid in ids]
