"""The model's forward replaced by a no-op, for measuring the host work around it (benchmarks only).

`install(engine, step_ms)` leaves everything around the model as it is (scheduler, decode rows, the step's
copies, token read-back, output processing, and in a server the IPC, HTTP and JSON work) and replaces what a
GPU would run: every prefill and decode step "samples" one ordinary text token (the last token of " the"), so
detokenization and streaming do real work. With step_ms > 0 every step that runs sequences (decode, prefill or
both) behaves like an asynchronous GPU step of that length: launching it returns at once, its tokens are ready
step_ms after the previous step's were (steps queue as on one GPU stream), and reading them waits until then
(in time.sleep, which releases the GIL as a GPU wait does). A prefill step is charged like a decode step: on a
small model a chunk of the default step budget costs about what a full decode step does, and a free prefill would
hide what admitting prompts costs a server whose requests arrive one by one. With step_ms = 0 the engine runs as
fast as its host work allows: the host ceiling.

Used by `ostinato bench host`, and by benchmarks/online/serve_vs_offline.py (`--noop-forward`) for both
`LLM.generate` and the server's engine core: `build_engine(args, step_ms)` is a module-level engine factory,
so `functools.partial(build_engine, step_ms=...)` can be pickled into the engine core process.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ostinato.errors import ConfigError

if TYPE_CHECKING:
    from ostinato.config import EngineArgs
    from ostinato.engine.engine import LLMEngine


class _NoOpModel:
    """Stands in for the decoder: hidden states are zeros, logits one-hot at `token_id` (greedy picks it)."""

    def __init__(self, real, max_rows: int, vocab_size: int, token_id: int):
        import torch

        self._real = real
        self._hidden = torch.zeros(max_rows, 1)  # grows to a prefill's token count
        self._logits = torch.zeros(max_rows, vocab_size)  # one row per sequence of a step
        self._logits[:, token_id] = 1.0

    def __call__(self, input_ids, positions, meta):
        if input_ids.shape[0] > self._hidden.shape[0]:
            import torch

            self._hidden = torch.zeros(input_ids.shape[0], 1)
        return self._hidden[: input_ids.shape[0]]

    def compute_logits(self, hidden, float32: bool = True):
        return self._logits[: hidden.shape[0]]

    def __getattr__(self, name):  # anything else (bind_kv_caches, config) from the real model
        return getattr(self._real, name)


class _DelayedStep:
    """A launched decode step whose tokens are 'ready' at a given time, as a GPU step's would be."""

    def __init__(self, pending, ready_at: float):
        self._pending, self._ready_at = pending, ready_at

    @property
    def seq_ids(self) -> list[int]:
        return self._pending.seq_ids

    def result(self):
        wait = self._ready_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return self._pending.result()


def text_token(tokenizer) -> int:
    """An ordinary token with text (the last token of " the"): what the no-op 'samples'."""
    return tokenizer.encode(" the", add_special_tokens=False)[-1]


def install(engine: "LLMEngine", step_ms: float = 0.0) -> int:
    """Replace the engine's forward (and in-graph sampling) by a no-op; returns the token it samples."""
    import torch

    runner = engine.runner
    if runner.device.type != "cpu":  # a GPU would replay its captured graphs, the real forward, regardless
        raise ConfigError("the no-op forward measures host work on CPU only: add --device cpu --dtype float32")
    token_id = text_token(engine.tokenizer)
    vocab = engine.model_config.vocab_size
    rows = runner.decode_batch.layout.rows  # at least max_num_seqs: the most sequences a step samples for
    runner.model = _NoOpModel(runner.model, rows, vocab, token_id)
    # On a GPU the decode step (forward and sampling) is one replay: the no-op replaces all of it, and the
    # tokens it 'sampled' are the ones its buffer holds.
    logits = runner.model.compute_logits(torch.zeros(rows, 1))
    runner.decode_step.sampled.fill_(token_id)
    for graphs in (runner.graphs, runner.processor_graphs):  # without and with the logits processors
        graphs.fn = lambda **inputs: logits[: next(iter(inputs.values())).shape[0]]
    if step_ms > 0:
        launch, delay = runner.launch, step_ms / 1000
        gpu_free_at = [0.0]

        def delayed_launch(out):
            pending = launch(out)
            if not (out.num_decode or out.seqs):  # an idle step only drops rows: no GPU work
                return pending
            gpu_free_at[0] = max(time.perf_counter(), gpu_free_at[0]) + delay
            return _DelayedStep(pending, gpu_free_at[0])

        runner.launch = delayed_launch
    return token_id


def build_engine(args: "EngineArgs", step_ms: float = 0.0) -> "LLMEngine":
    """An LLMEngine with the no-op forward (an engine factory for the server's engine core)."""
    from ostinato.engine.engine import LLMEngine

    engine = LLMEngine(args)
    install(engine, step_ms)
    return engine
