"""`ostinato bench host`: host microseconds per decode step, with the model's forward replaced by a no-op.

What is left is the Python around the graph: scheduling, preparing the step's inputs, the (no-op) step,
reading the tokens back and recording them, and the per-token output work. It runs on CPU on a tiny random
checkpoint it writes itself (the model's size does not matter: the forward is gone, tools/bench/noop_forward.py),
so the figure measures the engine's own overhead.

For each batch B and context C: B requests with prompts of C tokens (ignore_eos) are prefilled, then
`--steps` decode steps are timed one by one with time.perf_counter (the median step counts). "engine" is a
whole LLMEngine.step(); "core" is its scheduling and runner part (the Scheduler's and ModelRunner's calls),
without the per-token output work (detokenization, stop checks, the outputs). The requests' outputs are of
each `--output-kinds`: final_only is what LLM.generate asks for (one output per request, when it finishes),
timed as LLMEngine.step(); delta what the server streams (each step's new tokens and text), timed as the
server's engine core runs a step: LLMEngine.step_records() and pickling the step's one message. Each point is the median
of `--repeats` runs: the machine may be shared.

`--num-speculative-tokens K` times speculative steps instead (prompt lookup, every decoding sequence a verify row:
runner/spec_verify.py's path, its forward and logits no-ops too). The no-op repeats one token, so prompt lookup
proposes one token per row (the run's most recent earlier occurrence is one token back) and it is accepted: each
step verifies two positions per row and adds two tokens. Such steps are synchronous, so their host time is paid
in full on a GPU.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from ostinato.sampling_params import RequestOutputKind


def register(sub) -> None:
    from ostinato.cli_args import int_list

    p = sub.add_parser("bench-host", help="host microseconds per decode step, forward replaced by a no-op (CPU)")
    p.add_argument("--batch-sizes", type=int_list, default=(1, 16, 64, 256))
    p.add_argument("--contexts", type=int_list, default=(128, 2048))
    p.add_argument("--steps", type=int, default=200, help="decode steps timed per run")
    p.add_argument("--repeats", type=int, default=5, help="runs per point; the median is reported")
    p.add_argument("--output-kinds", type=_output_kinds,
                   default=(RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA),
                   help='the requests\' output kinds, each measured (default: "final_only delta")')
    p.add_argument("--num-speculative-tokens", type=int, default=0, metavar="K",
                   help="time speculative steps instead (--speculative-method ngram, K tokens proposed per row; "
                        "the no-op's output repeats one token, so prompt lookup proposes one and it is accepted: "
                        "each step verifies two positions per row)")
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=run)


def _output_kinds(value: str) -> tuple[RequestOutputKind, ...]:
    import argparse

    try:
        return tuple(RequestOutputKind(k) for k in value.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: use output kinds from "
                                         f"{[k.value for k in RequestOutputKind]}, space-separated") from None


def _checkpoint(root: Path, max_len: int) -> str:
    from ostinato.tools.checkpoint import make_checkpoint

    out = root / "tiny"
    make_checkpoint(out, shape="tiny")
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["max_position_embeddings"] = max_len  # the tiny shape stops at 2048; the forward never runs anyway
    cfg_path.write_text(json.dumps(cfg))
    return str(out)


class _Timer:
    """Wraps a bound method and adds its wall time to `seconds`."""

    def __init__(self, owner, name: str):
        self.seconds = 0.0
        self._owner, self._name = owner, name
        self._saved = owner.__dict__.get(name)  # a class attribute is put back by restore()
        inner = getattr(owner, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0

        setattr(owner, name, timed)

    def restore(self) -> None:
        if self._saved is not None:
            setattr(self._owner, self._name, self._saved)
        else:
            delattr(self._owner, self._name)


def measure(model_dir: str, batch: int, context: int, steps: int, engine_kwargs: dict | None = None,
            output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY) -> dict:
    """One run: microseconds per decode step (engine and core) at this batch and context, for requests whose
    outputs are of `output_kind`."""
    from ostinato.tools.bench import noop_forward
    from ostinato.config import EngineArgs
    from ostinato.engine.engine import LLMEngine
    from ostinato.sampling_params import SamplingParams

    spec = (engine_kwargs or {}).get("num_speculative_tokens") or 0
    max_len = context + (spec + 1) * (steps + 8)  # a verify step adds up to spec + 1 tokens
    block = 16
    # With speculation: decode rows for every verify row's k + 1 positions (the decode-graph path a GPU takes;
    # the scheduler still runs `batch` sequences, all there are).
    kwargs = dict(model=model_dir, device="cpu", dtype="float32", max_model_len=max_len,
                  max_num_seqs=batch * (spec + 1), max_num_batched_tokens=max(max_len, batch * (context + 1)),
                  num_kv_blocks=batch * (-(-max_len // block)) + 1, block_size=block)
    kwargs.update(engine_kwargs or {})
    engine = LLMEngine(EngineArgs(**kwargs))
    runner = engine.runner
    noop_forward.install(engine)
    params = SamplingParams(temperature=0.0, max_tokens=max_len - context - 4, ignore_eos=True,
                            output_kind=output_kind)
    for i in range(batch):
        engine.add_request(f"r{i}", [(i + j) % 500 + 1 for j in range(context)], params)
    while engine.scheduler.num_waiting:  # prefill everything first
        engine.step()
    engine.step()  # the first decode steps (first-use costs)
    engine.step()
    # The scheduler's and the runner's calls (the engine launches a step, then reads it by PendingStep.result;
    # execute stays timed for any caller that runs a step and waits).
    from ostinato.runner.pending import PendingStep

    timers = [_Timer(owner, name) for owner, name in (
        (engine.scheduler, "schedule"), (engine.scheduler, "update"), (runner, "launch"),
        (runner, "execute"), (PendingStep, "result"))]
    step = _server_core_step(engine) if output_kind is RequestOutputKind.DELTA else engine.step
    engine_s, core_s = [], []
    for _ in range(steps):  # per-step medians: a shared machine's hiccups do not move them
        core_before = sum(t.seconds for t in timers)
        t0 = time.perf_counter()
        step()
        engine_s.append(time.perf_counter() - t0)
        core_s.append(sum(t.seconds for t in timers) - core_before)
    for t in timers:
        t.restore()
    total, core = statistics.median(engine_s) * steps, statistics.median(core_s) * steps
    return {"batch": batch, "context": context, "engine_us": total / steps * 1e6, "core_us": core / steps * 1e6}


def _server_core_step(engine):
    """What the server's engine core does per step (engine/core_process.py): the step, as records, pickled into
    the one message it sends (all but the pipe's write)."""
    from multiprocessing.reduction import ForkingPickler

    def step() -> bytes:
        return ForkingPickler.dumps(("step", engine.step_records(), time.monotonic()))

    return step


def run(args) -> int:
    import torch

    torch.set_num_threads(1)  # host overhead is single-threaded Python; keep the shared machine quiet
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        spec_len = (args.num_speculative_tokens + 1) * (args.steps + 64)  # a verify step adds up to k + 1 tokens
        model_dir = _checkpoint(Path(tmp), max(args.contexts) + spec_len)
        spec = {} if not args.num_speculative_tokens else {
            "speculative_method": "ngram", "num_speculative_tokens": args.num_speculative_tokens}
        for context in args.contexts:
            for bs in args.batch_sizes:
                row = {"batch": bs, "context": context}
                for kind in args.output_kinds:
                    runs = [measure(model_dir, bs, context, args.steps, spec, output_kind=kind)
                            for _ in range(args.repeats)]
                    row[kind.value] = {"engine_us": statistics.median(r["engine_us"] for r in runs),
                                       "core_us": statistics.median(r["core_us"] for r in runs),
                                       "engine_us_runs": [round(r["engine_us"], 1) for r in runs]}
                rows.append(row)
                print(f"batch {bs:>4}  context {context:>5}  " + "  ".join(
                    f"{kind.value}: engine step {row[kind.value]['engine_us']:7.1f} us, core (scheduler + runner) "
                    f"{row[kind.value]['core_us']:6.1f} us" for kind in args.output_kinds)
                    + f"  (medians of {args.repeats})", flush=True)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=2))
    return 0
