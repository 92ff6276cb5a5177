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

Structured outputs (grammar-constrained rows) need `logits_columns`: the no-op's logits are then that many columns
wide (the vocabulary's first tokens: a byte-level BPE has every byte among them, so a grammar can always be
followed), written afresh at every step as a replay writes its static logits (the grammar masking writes -inf into
them in place), so the eager masking and re-draw after the replay work on a few hundred columns, not on the whole
vocabulary (passes that a GPU runs asynchronously). The forward of a decode step starts when it is launched (the
replay), and its tokens are ready step_ms later, or once the host has launched the masking, whichever comes last.

A speculative engine's verify step (runner/spec_verify.py) takes the path a GPU's takes in the steady state: its
rows flattened into decode rows, through the decode step's no-op, up to the decode rows' count (`bench host`
gives the engine k + 1 rows a sequence). A step with prompt chunks, or more rows, calls the same no-op for its
forward and its logits, which then have a row for every position the step samples (up to its token budget).

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

    def __init__(self, real, max_rows: int, vocab_size: int, token_id: int, fresh: bool = False):
        import torch

        self._real = real
        self._hidden = torch.zeros(max_rows, 1)  # grows to a prefill's token count
        self._logits = torch.zeros(max_rows, vocab_size)  # one row per sequence of a step
        self._logits[:, token_id] = 1.0
        # fresh: each call's logits in a buffer of their own, as a forward writes them (masking edits them)
        self._fresh = torch.empty_like(self._logits) if fresh else None

    def __call__(self, input_ids, positions, meta):
        if input_ids.shape[0] > self._hidden.shape[0]:
            import torch

            self._hidden = torch.zeros(input_ids.shape[0], 1)
        return self._hidden[: input_ids.shape[0]]

    def compute_logits(self, hidden, float32: bool = True):
        n = hidden.shape[0]
        if self._fresh is None:
            return self._logits[:n]
        return self._fresh[:n].copy_(self._logits[:n])

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


def install(engine: "LLMEngine", step_ms: float = 0.0, logits_columns: int | None = None) -> int:
    """Replace the engine's forward (and in-graph sampling) by a no-op; returns the token it samples.
    logits_columns: the no-op's logits that wide, fresh at every step (grammar-constrained rows need it)."""
    import torch

    runner = engine.runner
    if runner.device.type != "cpu":  # a GPU would replay its captured graphs, the real forward, regardless
        raise ConfigError("the no-op forward measures host work on CPU only: add --device cpu --dtype float32")
    token_id = text_token(engine.tokenizer)
    vocab = engine.model_config.vocab_size
    columns = vocab if logits_columns is None else min(vocab, logits_columns)
    if token_id >= columns:
        raise ConfigError(f"the no-op samples token {token_id}, outside logits_columns={logits_columns}")
    rows = runner.decode_batch.layout.rows  # at least max_num_seqs: the most sequences a step samples for
    verifier = getattr(runner, "verifier", None)
    # A speculative step samples every position of its verify rows: up to the step's token budget.
    logit_rows = rows if verifier is None else max(rows, engine.scheduler_config.max_num_batched_tokens)
    runner.model = _NoOpModel(runner.model, logit_rows, columns, token_id, fresh=logits_columns is not None)
    if verifier is not None:  # the verify step's prefill path runs the no-op's forward and logits, its decode
        verifier.model = runner.model  # path the decode step's (below), as a GPU's decode graphs would
        verifier.eager_decode_rows = rows
    clock = _GpuClock(step_ms / 1000)
    sampled, hidden = runner.decode_step.sampled, torch.zeros(rows, 0)
    sampled.fill_(token_id)

    def replay(**inputs):
        # On a GPU the decode step (forward and sampling) is one replay: the no-op replaces all of it, and the
        # tokens it 'samples' are the ones in the step's buffer (written afresh where a grammar's re-draw may
        # have changed them).
        n = next(iter(inputs.values())).shape[0]
        clock.forward_launched()
        if logits_columns is not None:
            sampled[:n].fill_(token_id)
        return runner.model.compute_logits(hidden[:n])

    for graphs in (runner.graphs, runner.processor_graphs):  # without and with the logits processors
        graphs.fn = replay
    if step_ms > 0:
        launch = runner.launch

        def delayed_launch(out, masks=None):
            if not (out.num_decode or out.seqs):  # an idle step only drops rows: no GPU work
                return launch(out) if masks is None else launch(out, masks)
            clock.step_started()
            pending = launch(out) if masks is None else launch(out, masks)
            return _DelayedStep(pending, clock.step_launched())

        runner.launch = delayed_launch
    return token_id


class _GpuClock:
    """When a no-op step's tokens are ready, as on one GPU stream: its forward starts when it is launched (a
    decode step's at its replay) or when the step before it ended, and lasts `delay`; work launched after the
    forward (the grammar masking) adds no GPU time but cannot end before it was launched."""

    def __init__(self, delay: float):
        self.delay, self._free_at, self._forward_done = delay, 0.0, 0.0

    def step_started(self) -> None:
        self.forward_launched()  # a prefill's forward; a decode replay, later in the step, starts it again

    def forward_launched(self) -> None:
        self._forward_done = max(time.perf_counter(), self._free_at) + self.delay

    def step_launched(self) -> float:
        self._free_at = max(self._forward_done, time.perf_counter())
        return self._free_at


def build_engine(args: "EngineArgs", step_ms: float = 0.0) -> "LLMEngine":
    """An LLMEngine with the no-op forward (an engine factory for the server's engine core)."""
    from ostinato.engine.engine import LLMEngine

    engine = LLMEngine(args)
    install(engine, step_ms)
    return engine
