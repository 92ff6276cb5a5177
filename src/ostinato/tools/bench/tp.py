"""Tensor-parallel decode measurement: TP=N against TP=1 on one checkpoint, graph against eager, and the
share of a decode step spent in NCCL collectives (torch.profiler), in one command:

    PYTHONPATH=src python -m ostinato.tools.bench.tp OUT_DIR [--checkpoint DIR] [--shape llama-3.1-8b]
        [--tp 1 2] [--batch-sizes 1 8 32] [--context 512]

Builds a random bf16 checkpoint of `--shape` in `--checkpoint` once (reused when it is there), then runs each
tensor-parallel size in a fresh process (a clean GPU for each), writes OUT_DIR/tp<N>.json per size and
OUT_DIR/summary.json, and prints a table. Per batch size it reports:
- graph_ms / eager_ms: one decode step (copy of the decode rows + replay, sampling inside), as `ostinato bench`
  times it (tools/bench.replay_ms, CUDA events, median), on every rank at once; rank 0's figure;
- nccl_share_graph / nccl_share_eager: the summed time of NCCL kernels in a step over the step's time
  (profiled on rank 0; includes time spent waiting for the other rank inside the collective);
- collectives_per_step: NCCL kernels per step (2 all-reduces per layer, one for the embedding, one all-gather
  of the logits);
- engine_step_ms: a whole LLMEngine.step in generation (scheduler, the step sent to every rank, detokenizer),
  from two runs of different lengths;
and per TP size step_channel_us: what sending one message to the other ranks costs rank 0.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

MODULE = "ostinato.tools.bench.tp"  # not __name__: that is "__main__" under `python -m`, on rank 0 only


def nccl_share(runner, bs: int, context: int, seed: int, steps: int) -> dict:
    """On every rank (call_all): profile `steps` decode steps, graph and eager, and sum the NCCL kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ostinato.tools.bench.decode import rows_loaded

    step = runner.decode_step
    # CPU (a dry run of this script): gloo collectives are CPU ops named c10d::...
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activity, collective = (ProfilerActivity.CUDA, "nccl") if cuda else (ProfilerActivity.CPU, "c10d::")
    out = {}
    with rows_loaded(runner, bs, context, torch.Generator().manual_seed(seed)) as batch:
        rows = batch.copy_to_device(bs)
        size = runner.step_graphs().graph_size(bs)
        modes = {"eager": lambda: step(rows)}
        if size is not None:
            modes["graph"] = lambda: (batch.copy_to_device(size), runner.step_graphs().replay_filled(bs))
        for mode, fn in modes.items():
            for _ in range(3):
                fn()
            sync()
            t0 = time.perf_counter()
            with profile(activities=[activity]) as prof:
                for _ in range(steps):
                    fn()
                sync()
            wall_us = (time.perf_counter() - t0) * 1e6 / steps
            nccl_us = kernel_us = 0.0
            nccl_count = 0
            for item in prof.key_averages():
                us = getattr(item, "device_time_total", None) or getattr(item, "cuda_time_total", 0.0)
                kernel_us += us
                if collective in item.key.lower():
                    nccl_us += us
                    nccl_count += item.count
            out[mode] = {"nccl_us_per_step": nccl_us / steps, "kernel_us_per_step": kernel_us / steps,
                         "profiled_wall_us_per_step": wall_us, "collectives_per_step": nccl_count / steps}
    return out


def noop(runner) -> None:
    """Nothing, on every rank: call_all of this times the step channel alone."""


def channel_us(runner, n: int = 2000) -> float | None:
    """Microseconds rank 0 spends sending one message to every other rank (what each step pays)."""
    if not runner.rank_health():  # one rank: no channel
        return None
    t0 = time.perf_counter()
    for _ in range(n):
        runner.call_all(f"{MODULE}:noop")
    return (time.perf_counter() - t0) / n * 1e6


def engine_step_ms(engine, bs: int, context: int) -> float:
    """Milliseconds per engine step in decode: (long run - short run) / extra steps, `bs` sequences at once."""
    from ostinato.sampling_params import SamplingParams

    def run(max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for i in range(bs):
            engine.add_request(f"r{max_tokens}-{i}-{time.monotonic_ns()}", [1 + i % 50] * context, params)
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - t0

    run(4)  # warm-up
    short, long = run(8), run(72)
    return (long - short) / 64 * 1e3


def measure_one(args) -> dict:
    import torch

    from ostinato.config import EngineArgs
    from ostinato.engine.engine import LLMEngine
    from ostinato.tools.bench.decode import replay_ms

    sizes = tuple(args.batch_sizes)
    engine = LLMEngine(EngineArgs(
        model=args.checkpoint, dtype=args.dtype, tensor_parallel_size=args.one, max_num_seqs=max(sizes),
        max_model_len=args.context + 128, cuda_graph_sizes=sizes, num_kv_blocks=args.num_kv_blocks))
    runner = engine.runner
    gen = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        for bs in sizes:
            eager_ms, graph_ms = replay_ms(runner, bs, args.context, gen, args.iters, args.warmup)
            share = runner.call_all(f"{MODULE}:nccl_share", bs, args.context, bs, args.profile_steps)
            row = {"tp": args.one, "batch": bs, "context": args.context, "graph_ms": graph_ms, "eager_ms": eager_ms}
            for mode, ms in (("graph", graph_ms), ("eager", eager_ms)):
                if mode in share and ms:
                    row[f"nccl_share_{mode}"] = share[mode]["nccl_us_per_step"] / (ms * 1e3)
                    row[f"collectives_per_step_{mode}"] = share[mode]["collectives_per_step"]
                    row[f"profile_{mode}"] = share[mode]
            rows.append(row)
            print(f"tp {args.one} bs {bs}: graph {graph_ms} ms, eager {eager_ms:.3f} ms, {share}", flush=True)
        for bs in sizes:
            step = engine_step_ms(engine, bs, min(args.context, 128))
            next(r for r in rows if r["batch"] == bs)["engine_step_ms"] = step
    send_us = channel_us(runner)
    result = {"tp": args.one, "checkpoint": args.checkpoint, "step_channel_us": send_us, "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "graph_status": engine.graph_status,
              "weights_bytes_rank0": runner.weights_bytes, "rows": rows}
    engine.shutdown()
    return result


def _fmt(v, spec="{:.3f}") -> str:
    return "-" if v is None else spec.format(v)


def table(results: dict[int, dict]) -> str:
    lines = ["  tp  batch  graph ms  eager ms  graph/eager  vs TP=1 (graph)  NCCL share graph  eager  "
             "collectives/step  engine step ms"]
    base = {r["batch"]: r for r in results.get(1, {}).get("rows", [])}
    for tp in sorted(results):
        for r in results[tp]["rows"]:
            b = base.get(r["batch"])
            ratio = r["graph_ms"] / b["graph_ms"] if b and b.get("graph_ms") and r.get("graph_ms") else None
            lines.append(
                f"{tp:>4}  {r['batch']:>5}  {_fmt(r['graph_ms']):>8}  {_fmt(r['eager_ms']):>8}  "
                f"{_fmt(r['eager_ms'] / r['graph_ms'] if r['graph_ms'] else None, 'x{:.2f}'):>11}  "
                f"{_fmt(ratio, 'x{:.2f}'):>15}  {_fmt(r.get('nccl_share_graph'), '{:.0%}'):>16}  "
                f"{_fmt(r.get('nccl_share_eager'), '{:.0%}'):>5}  "
                f"{_fmt(r.get('collectives_per_step_graph'), '{:.0f}'):>16}  {_fmt(r.get('engine_step_ms')):>14}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--checkpoint", default="/tmp/ck-llama-3.1-8b")
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--profile-steps", type=int, default=20)
    p.add_argument("--num-kv-blocks", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # internal: one TP size, this process
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.one is not None:
        (out / f"tp{args.one}.json").write_text(json.dumps(measure_one(args), indent=2))
        return 0
    if not (Path(args.checkpoint) / "config.json").is_file():
        from ostinato.tools.checkpoint import make_checkpoint

        t0 = time.perf_counter()
        make_checkpoint(args.checkpoint, shape=args.shape, dtype="bfloat16", progress=True)
        print(f"built {args.shape} in {time.perf_counter() - t0:.0f} s -> {args.checkpoint}", flush=True)
    results = {}
    for tp in args.tp:
        cmd = [sys.executable, "-m", MODULE, str(out), "--checkpoint", args.checkpoint, "--one", str(tp),
               "--batch-sizes", *map(str, args.batch_sizes), "--context", str(args.context), "--iters",
               str(args.iters), "--warmup", str(args.warmup), "--profile-steps", str(args.profile_steps),
               "--num-kv-blocks", str(args.num_kv_blocks), "--dtype", args.dtype]
        t0 = time.perf_counter()
        if subprocess.run(cmd).returncode != 0:
            print(f"TP={tp} failed; see above")
            continue
        print(f"TP={tp} measured in {time.perf_counter() - t0:.0f} s", flush=True)
        results[tp] = json.loads((out / f"tp{tp}.json").read_text())
    print(table(results))
    for tp, r in results.items():
        if r.get("step_channel_us") is not None:
            print(f"TP={tp}: sending a step to the other ranks costs rank 0 {r['step_channel_us']:.1f} us")
    summary = {"results": results}
    if 1 in results and 2 in results:
        g1 = next(r["graph_ms"] for r in results[1]["rows"] if r["batch"] == 1)
        g2 = next(r["graph_ms"] for r in results[2]["rows"] if r["batch"] == 1)
        if g1 and g2:
            summary["tp2_over_tp1_batch1_graph"] = g2 / g1
            print(f"goal TP=2 <= 0.6 x TP=1 at batch 1 (graph): {g2:.3f} / {g1:.3f} ms = x{g2 / g1:.2f} "
                  f"{'MET' if g2 / g1 <= 0.6 else 'NOT MET'}")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
