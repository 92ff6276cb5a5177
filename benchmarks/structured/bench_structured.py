"""Structured outputs' cost: the decode step with every row JSON-schema constrained against none, at several
batch sizes, through the real engine loop (mask filling on the CPU, its copy, the eager masking and re-draw after
the replay all count), and the grammar compile time of the 50 generated test schemas, first and cached.

    PYTHONPATH=src python3 benchmarks/structured/bench_structured.py --model CK --batch-sizes 1,16,64 \
        --output-json structured.json

CK is a random-weight checkpoint (benchmarks/README.md) or `smollm2-135m`: the grammar forces the format whatever
the weights, and the step's speed does not depend on them.

The host's side alone, on a CPU: `--noop-forward-ms MS` replaces the forward by a no-op that acts as an asynchronous
GPU step of MS ms (tools/bench/noop_forward.py). Its logits are narrow and the re-draw is an argmax, so the masking
costs about what its launches would, not CPU passes over the vocabulary. The grammar work (accept, fill) is real; a
constrained step slower than MS is host-bound.

    PYTHONPATH=src python3 benchmarks/structured/bench_structured.py --model CK --noop-forward-ms 1.0 \
        --batch-sizes 1,16,64 --no-compile

The constrained rows follow a schema that forces a long answer (an array of at least 400 bounded integers), so
that every row decodes for the whole measured window; the unconstrained rows ignore EOS for the same reason. A
step's time is the wall time of LLMEngine.step() over the steps where every row decodes.

Where a constrained step's time goes, per step over the same window (host times, from timing wrappers around the
engine's own functions): `wait_ms`, the host waiting for the GPU (PendingStep.result: near 0 means the loop is
host-bound, and the GPU waits for the host); `fill_ms`, filling the bitmasks (GrammarSet.fill); `accept_ms`, the
matchers accepting the step's tokens (GrammarSet.accept_tokens); `mask_ms`, the runner's masking and re-draw
after the replay (constrain_decode, launches only); `masks_ms`, the part of mask_ms in the engine's masks callable
(the wait for the in-flight step's tokens, taking them, accept and fill): mask_ms - masks_ms is the launches.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

NOOP_LOGITS_COLUMNS = 512  # the no-op's logits: the random checkpoints' trained BPE tokens, every byte among them
PARTS = ("wait", "fill", "accept", "mask", "masks")
LONG = {"type": "object", "properties": {"values": {"type": "array", "minItems": 400, "items": {
    "type": "integer", "minimum": 0, "maximum": 999}}}, "required": ["values"], "additionalProperties": False}


@contextlib.contextmanager
def host_probe(noop: bool = False):
    """Time spent in the functions named in the module docstring, accumulated into the dict it yields (noop: the
    wait is the no-op step's, which sleeps until its tokens are 'ready')."""
    from unittest import mock

    from ostinato.engine.engine import LLMEngine
    from ostinato.engine.grammar import GrammarSet
    from ostinato.runner import runner as runner_module
    from ostinato.runner.pending import PendingStep
    from ostinato.tools.bench import noop_forward

    spent: dict[str, float] = defaultdict(float)

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0
        return wrapper

    probes = [(noop_forward._DelayedStep if noop else PendingStep, "result", "wait"), (GrammarSet, "fill", "fill"),
              (GrammarSet, "accept_tokens", "accept"), (runner_module, "constrain_decode", "mask"),
              (LLMEngine, "_grammar_masks", "masks")]
    with contextlib.ExitStack() as stack:
        for owner, attr, name in probes:
            stack.enter_context(mock.patch.object(owner, attr, timed(name, getattr(owner, attr))))
        yield spent


def step_times(engine, batch: int, constrained: bool, tokens: int, skip: int,
               parts: dict[str, list[float]] | None = None, noop: bool = False) -> list[float]:
    """Wall times of the steps where every row decodes; `parts`: each probed function's time per such step."""
    from ostinato.sampling_params import SamplingParams
    from ostinato.structured_outputs import StructuredOutputs

    spec = StructuredOutputs(json=LONG) if constrained else None
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, structured_outputs=spec)
    if spec is not None:
        engine.constrained.check(spec)  # compiled before timing: the compile is measured apart
    for i in range(batch):
        engine.add_request(f"{'c' if constrained else 'u'}{batch}-{i}", "Write the numbers as JSON:", params)
    times, per_step = [], []
    with host_probe(noop) as spent:
        while engine.has_unfinished():
            before = dict(spent)
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
            per_step.append({k: v - before.get(k, 0.0) for k, v in spent.items()})
    window = slice(skip, tokens - 4)  # past the prefills, before rows start to finish
    if parts is not None:
        for step in per_step[window]:
            for k in PARTS:
                parts[k].append(step.get(k, 0.0))
    return times[window]


def compile_times(engine, count: int) -> dict:
    from support.schemas import generated_schemas

    from ostinato.engine.grammar import ConstrainedRequests
    from ostinato.structured_outputs import StructuredOutputs

    fresh = ConstrainedRequests(engine.tokenizer, engine.model_config.vocab_size, engine.eos_ids)
    specs = [StructuredOutputs(json=s) for s in generated_schemas(count)]
    t0 = time.perf_counter()
    fresh.check(specs[0])  # the first pays for the tokenizer's vocabulary too
    first_incl_tokenizer = time.perf_counter() - t0
    t0 = time.perf_counter()
    for s in specs[1:]:
        fresh.check(s)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for s in specs:
        fresh.check(s)
    cached = time.perf_counter() - t0
    return {"schemas": count, "first_schema_with_tokenizer_info_s": first_incl_tokenizer,
            "first_compile_mean_ms": 1e3 * first / (count - 1), "cached_mean_ms": 1e3 * cached / count}


def make_engine(args):
    from ostinato.config import EngineArgs
    from ostinato.engine.engine import LLMEngine

    most = max(64, *(int(b) for b in args.batch_sizes.split(",")))
    if args.noop_forward_ms is None:
        return LLMEngine(EngineArgs(model=args.model, dtype=args.dtype, max_num_seqs=most, max_model_len=1024))
    from ostinato.tools.bench import noop_forward

    engine = LLMEngine(EngineArgs(model=args.model, device="cpu", dtype="float32", max_num_seqs=most,
                                  max_model_len=1024, num_kv_blocks=most * ((args.tokens + 64) // 16 + 1)))
    noop_forward.install(engine, args.noop_forward_ms, logits_columns=NOOP_LOGITS_COLUMNS)
    # The constrained rows' re-draw as one cheap op, as a GPU launch costs the host: the torch sampling path
    # on a CPU is a pass over the logits (exp of the masked -inf is slow) that no GPU step makes the host wait for.
    # Greedy, as the no-op's own draw (one token, whatever the settings). This process only.
    from ostinato.runner import structured

    structured.sample_rows = lambda logits, rows, out, batch_invariant=False: out.copy_(logits.argmax(dim=-1))
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--tokens", type=int, default=160, help="tokens each row generates")
    ap.add_argument("--skip", type=int, default=16, help="first steps left out (prefills, warm-up)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--noop-forward-ms", type=float, default=None,
                    help="CPU: the forward as a no-op GPU step of this many ms (the host's side alone)")
    ap.add_argument("--no-compile", action="store_true", help="skip the 50 schemas' compile times")
    args = ap.parse_args()
    engine = make_engine(args)
    result = {"model": args.model, "noop_forward_ms": args.noop_forward_ms, "decode": [],
              "compile": None if args.no_compile else compile_times(engine, 50)}
    sizes, noop = [int(b) for b in args.batch_sizes.split(",")], args.noop_forward_ms is not None
    for batch in sizes:
        row = {"batch": batch}
        for constrained in (False, True):
            parts: dict[str, list[float]] = defaultdict(list)
            times = step_times(engine, batch, constrained, args.tokens, args.skip, parts, noop)
            name = "constrained" if constrained else "unconstrained"
            row[f"{name}_ms"] = 1e3 * statistics.median(times)
            for k, v in parts.items():
                row[f"{name}_{k}_ms"] = 1e3 * statistics.median(v)
        row["ratio"] = row["constrained_ms"] / row["unconstrained_ms"]
        result["decode"].append(row)
        print(json.dumps(row), flush=True)
    stats = engine.stats()
    result["decode_steps_graph"], result["decode_steps_eager"] = stats.decode_steps_graph, stats.decode_steps_eager
    if result["compile"] is not None:
        print(json.dumps(result["compile"]))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
