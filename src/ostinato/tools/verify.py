"""`ostinato verify`: prove from a profiler trace which path each decode step takes.

Runs real decode steps under torch.profiler, reads the Chrome trace it exports, and counts per decode step
(each wrapped by the runner in a `ostinato.decode_step[B]` annotation) the graph launches (cudaGraphLaunch) and
the kernels launched outside any graph (cudaLaunchKernel, cuLaunchKernel, cuLaunchKernelEx: eager torch ops,
Triton, the sampler). Exit code 1 when a batch size that should replay did not, or when graphs ran although
--enforce-eager was asked for.
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

GRAPH_LAUNCH_NAMES = ("cudaGraphLaunch", "cuGraphLaunch")
KERNEL_LAUNCH_NAMES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                       "cudaLaunchCooperativeKernel")
STEP_ANNOTATION = re.compile(r"^ostinato\.decode_step\[(\d+)\]$")


@dataclass(frozen=True)
class StepCount:
    batch_size: int
    graph_launches: int
    kernel_launches: int  # launched outside any graph, inside the step


@dataclass(frozen=True)
class SizeVerdict:
    batch_size: int
    steps: int
    graph_launches_per_step: float
    kernel_launches_per_step: float
    expected: str  # "graph" | "eager"
    ok: bool


def count_launches(trace_events: list[dict]) -> list[StepCount]:
    """Per decode-step annotation, count the runtime launch calls whose start falls inside it (same thread)."""
    steps = []
    launches = []
    for ev in trace_events:
        if ev.get("ph") != "X":
            continue
        name = ev.get("name", "")
        m = STEP_ANNOTATION.match(name)
        if m and ev.get("cat") in ("user_annotation", "cpu_op", "python_function", None):
            steps.append((float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0)), ev.get("tid"), int(m.group(1))))
        elif name in GRAPH_LAUNCH_NAMES or name in KERNEL_LAUNCH_NAMES:
            launches.append((float(ev["ts"]), ev.get("tid"), name in GRAPH_LAUNCH_NAMES))
    steps.sort()
    out = []
    for start, end, tid, bs in steps:
        inside = [g for ts, t, g in launches if start <= ts <= end and t == tid]
        out.append(StepCount(bs, sum(inside), len(inside) - sum(inside)))
    return out


def judge(counts: list[StepCount], captured_sizes: tuple[int, ...], graphs_enabled: bool) -> list[SizeVerdict]:
    """A size that maps to a captured graph must show exactly one graph launch per step; any other size
    (or graphs off) must show none."""
    by_size: dict[int, list[StepCount]] = {}
    for c in counts:
        by_size.setdefault(c.batch_size, []).append(c)
    verdicts = []
    largest = max(captured_sizes) if captured_sizes else 0
    for bs in sorted(by_size):
        cs = by_size[bs]
        expect_graph = graphs_enabled and bs <= largest
        graph_ok = all(c.graph_launches == (1 if expect_graph else 0) for c in cs)
        verdicts.append(SizeVerdict(bs, len(cs), sum(c.graph_launches for c in cs) / len(cs),
                                    sum(c.kernel_launches for c in cs) / len(cs),
                                    "graph" if expect_graph else "eager", graph_ok))
    return verdicts


def format_table(verdicts: list[SizeVerdict]) -> str:
    rows = ["batch  steps  graph launches/step  kernel launches/step (outside graphs)  expected  verdict"]
    for v in verdicts:
        rows.append(f"{v.batch_size:>5}  {v.steps:>5}  {v.graph_launches_per_step:>19.2f}  "
                    f"{v.kernel_launches_per_step:>37.1f}  {v.expected:>8}  {'OK' if v.ok else 'FAIL'}")
    return "\n".join(rows)


def register(sub) -> None:
    from ostinato.cli_args import int_list, add_engine_args

    p = sub.add_parser("verify", help="profile real decode steps and prove which path (graph or eager) they take")
    add_engine_args(p)
    p.add_argument("--batch-sizes", type=int_list, default=None,
                   help="decode batch sizes to check (default: 1, a padded size, the largest captured, one above)")
    p.add_argument("--steps", type=int, default=5, help="decode steps profiled per batch size")
    p.add_argument("--trace", default=None, help="save the Chrome trace here")
    p.set_defaults(func=run)


def default_batch_sizes(captured: tuple[int, ...], max_num_seqs: int) -> tuple[int, ...]:
    if not captured:
        return (1, min(3, max_num_seqs))
    sizes = {1, captured[-1]}
    padded = next((s + 1 for s in captured if s + 1 not in captured and s + 1 <= captured[-1]), None)
    if padded:
        sizes.add(padded)
    if captured[-1] + 1 <= max_num_seqs:
        sizes.add(captured[-1] + 1)
    return tuple(sorted(sizes))


def profile_start(runner) -> None:
    """Start torch.profiler on this rank (through call_all under tensor parallelism: on every rank)."""
    from torch.profiler import ProfilerActivity, profile

    runner.verify_profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    runner.verify_profiler.__enter__()


def profile_stop(runner, path: str) -> None:
    """Stop this rank's profiler once its queued steps ran, and export its trace to `path`.rankN.json."""
    import torch

    torch.cuda.synchronize()
    runner.verify_profiler.__exit__(None, None, None)
    runner.verify_profiler.export_chrome_trace(f"{path}.rank{runner.tp.rank}.json")
    del runner.verify_profiler


def _on_every_rank(engine, target: str, *args) -> None:
    """Run a function of this module on every rank (one rank's runner runs it itself)."""
    engine.runner.call_all(f"{__name__}:{target}", *args)


def profile_decode_steps(engine, batch_sizes, steps: int, trace_path: Path) -> dict[int, list[StepCount]]:
    """Bring `bs` sequences to the decode phase, then profile `steps` decode steps for each batch size, on
    every tensor-parallel rank (each rank writes its own trace; ranks share this host's file system).
    Returns each rank's step counts."""
    import torch

    from ostinato.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    world = getattr(engine.runner, "world_size", 1)
    events: dict[int, list[dict]] = {rank: [] for rank in range(world)}
    for bs in batch_sizes:
        rids = [f"verify-{bs}-{i}" for i in range(bs)]
        for i, rid in enumerate(rids):
            engine.add_request(rid, [1 + (i % 50)] * 8, params)
        while engine.scheduler.num_waiting:  # prefill steps until every sequence decodes
            engine.step()
        torch.cuda.synchronize()
        _on_every_rank(engine, "profile_start")
        for _ in range(steps):
            engine.step()
        path = trace_path if len(batch_sizes) == 1 else trace_path.with_suffix(f".bs{bs}.json")
        _on_every_rank(engine, "profile_stop", str(path))
        for rank in range(world):
            events[rank].extend(json.loads(Path(f"{path}.rank{rank}.json").read_text())["traceEvents"])
        for rid in rids:
            engine.abort(rid)
    return {rank: count_launches(ev) for rank, ev in events.items()}


def run(args) -> int:
    import torch

    from ostinato.cli_args import engine_args_from
    from ostinato.engine.engine import LLMEngine

    if not torch.cuda.is_available():
        print("error: verify profiles CUDA kernel and graph launches and needs a CUDA GPU; torch sees none")
        return 2

    engine = LLMEngine(engine_args_from(args))
    st = engine.stats()
    sizes = args.batch_sizes or default_batch_sizes(st.captured_sizes, engine.scheduler_config.max_num_seqs)
    if max(sizes) > engine.scheduler_config.max_num_seqs:
        print(f"error: batch size {max(sizes)} is above --max-num-seqs {engine.scheduler_config.max_num_seqs}")
        return 2
    trace = Path(args.trace) if args.trace else Path(tempfile.mkdtemp()) / "ostinato-verify.json"
    counts = profile_decode_steps(engine, sizes, args.steps, trace)
    print(f"decode graphs: {engine.graph_status}; captured sizes: {list(st.captured_sizes)}")
    ok = True
    for rank, rank_counts in counts.items():
        verdicts = judge(rank_counts, st.captured_sizes, st.graphs_enabled)
        if len(counts) > 1:
            print(f"rank {rank}:")
        print(format_table(verdicts))
        missing = sorted(set(sizes) - {v.batch_size for v in verdicts})
        if missing:
            print(f"FAIL: no decode step was seen for batch sizes {missing}")
        ok = ok and all(v.ok for v in verdicts) and not missing
    if args.trace:
        print(f"traces written to {trace}.rank*.json")
    engine.shutdown()
    return 0 if ok else 1
