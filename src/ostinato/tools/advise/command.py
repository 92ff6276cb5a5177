"""`ostinato advise`: is CUDA-graph replay worth it for this GPU, model and workload, and which batch sizes
should be captured?

    ostinato advise MODEL --prompt-len 50:500 --output-len 200:1000 --save-measurements m.json
    ostinato advise MODEL --measurements m.json --prompt-len 4000 --output-len 64     # no GPU needed
    ostinato advise MODEL --measurements m.json --from-metrics http://localhost:8000/metrics

It measures on the GPU (advise_measure), or loads saved measurements; takes a workload as parameters, a
JSONL trace or a running server's decode batch-size histogram (advise_workload); estimates eager, the default
sizes and a recommended size set end to end (advise_estimate, the assumptions printed with the report); and
writes the recommended sizes where `--cuda-graph-sizes @FILE` reads them, a JSON report and PNG plots.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict
from pathlib import Path

from ostinato.errors import ConfigError
from ostinato.tools.advise.costs import CostModel, Measurements
from ostinato.tools.advise.estimate import Advice, Estimate, advise
from ostinato.tools.advise.workload import Workload, read_metrics_text, workload_from_metrics, workload_from_params, \
    workload_from_trace

SIZES_FILE = "cuda_graph_sizes.txt"
_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """'512MiB', '1.5GiB', '2g', '1048576' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"--graph-memory-budget must be a size like 512MiB or 1.5GiB, got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_overhead(text: str) -> tuple[float, float]:
    """'0.3' -> (0.3, 0.0); '0.25:0.016' -> (0.25, 0.016): milliseconds per step and per sequence."""
    try:
        fixed, _, per_seq = text.partition(":")
        values = (float(fixed), float(per_seq or 0.0))
    except ValueError:
        raise ConfigError(f"--host-overhead-ms must be A or A:B in milliseconds, got {text!r}") from None
    if min(values) < 0:
        raise ConfigError(f"--host-overhead-ms must not be negative, got {text!r}")
    return values


def register(sub) -> None:
    from ostinato.cli_args import int_list, add_engine_args

    p = sub.add_parser("advise", help="is CUDA-graph replay worth it here, and which batch sizes to capture")
    add_engine_args(p)
    w = p.add_argument_group("workload (parameters, --trace or --from-metrics)")
    w.add_argument("--prompt-len", default=None, help="prompt tokens: N or LOW:HIGH (uniform)")
    w.add_argument("--output-len", default=None, help="output tokens: N or LOW:HIGH (uniform)")
    w.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second (default: "
                   "every request at once)")
    w.add_argument("--concurrency", type=int, default=None, help="closed loop: this many requests in flight")
    w.add_argument("--num-requests", type=int, default=256)
    w.add_argument("--workload-seed", type=int, default=0)
    w.add_argument("--trace", default=None, help="JSONL: one {prompt_len, output_len, arrival_s} per line")
    w.add_argument("--from-metrics", default=None, help="a server's /metrics URL (or a saved copy): its "
                   "ostinato:decode_batch_size histogram")
    w.add_argument("--name", default=None, help="the workload's name in the report")
    a = p.add_argument_group("advise")
    a.add_argument("--measurements", default=None, help="load measurements (JSON) instead of measuring")
    a.add_argument("--save-measurements", default=None, help="write what was measured here (JSON)")
    a.add_argument("--contexts", type=int_list, default=(256, 1024, 4096),
                   help="decode contexts to time at (tokens per sequence)")
    a.add_argument("--prefill-lens", type=int_list, default=(64, 256, 1024, 4096),
                   help="prompt lengths to time prefill at (the workload's are added)")
    a.add_argument("--iters", type=int, default=20)
    a.add_argument("--warmup", type=int, default=3)
    a.add_argument("--graph-memory-budget", type=parse_bytes, default=None,
                   help="most memory the recommended graphs may take, e.g. 512MiB (default: the default sizes')")
    a.add_argument("--host-overhead-ms", default="0", help="host work per decode step, the same with and "
                   "without graphs: A or A:B for A + B * batch ms (a whole engine step minus the forward-only replay, "
                   "from `ostinato bench engine`)")
    a.add_argument("--min-gain", type=float, default=0.02, help="least throughput gain worth enabling graphs")
    a.add_argument("--out", default="advise-out", help=f"folder for {SIZES_FILE} and the plots")
    a.add_argument("--json", default=None, help="write the whole report as JSON")
    a.add_argument("--no-plots", action="store_true")
    p.set_defaults(func=run)


def load_workload(args) -> Workload:
    given = [x for x in ("trace", "from_metrics") if getattr(args, x)]
    params = args.prompt_len is not None or args.output_len is not None
    if len(given) + params != 1:
        raise ConfigError("give one workload: --prompt-len and --output-len, --trace FILE, or --from-metrics URL")
    if args.trace:
        w = workload_from_trace(args.trace, args.concurrency)
    elif args.from_metrics:
        w = workload_from_metrics(read_metrics_text(args.from_metrics), f"metrics of {args.from_metrics}")
    else:
        if args.prompt_len is None or args.output_len is None:
            raise ConfigError("a parameter workload needs both --prompt-len and --output-len")
        w = workload_from_params(args.prompt_len, args.output_len, args.num_requests, args.request_rate,
                                 args.concurrency, args.workload_seed, _describe(args))
    if args.name:
        w = Workload(args.name, w.requests, w.concurrency, w.batch_histogram, w.mean_prompt_len,
                     w.mean_output_len, w.num_requests)
    return w


def _describe(args) -> str:
    arrivals = (f"{args.request_rate:g} req/s" if args.request_rate else
                f"concurrency {args.concurrency}" if args.concurrency else "all at once")
    return f"prompts {args.prompt_len}, outputs {args.output_len}, {args.num_requests} requests, {arrivals}"


def _measure(args, workload: Workload) -> Measurements:
    import torch

    if not torch.cuda.is_available() or args.device == "cpu":
        raise ConfigError("advise measures CUDA-graph replay and needs a CUDA GPU, and this machine has none. "
                          "Run it on the GPU (add --save-measurements FILE to keep the figures), or re-advise "
                          "anywhere from saved figures with --measurements FILE")
    if args.enforce_eager:
        raise ConfigError("advise compares graphs with eager; drop --enforce-eager")
    if args.tensor_parallel_size != 1:  # it times prefill and graph captures on rank 0 alone
        raise ConfigError("advise measures one GPU; drop --tensor-parallel-size (run it at size 1)")
    from ostinato.cli_args import engine_args_from
    from ostinato.engine.engine import LLMEngine
    from ostinato.tools.advise.measure import measure

    engine = LLMEngine(engine_args_from(args))
    lens = set(args.prefill_lens)
    if workload.requests:
        prompts = sorted(r.prompt_len for r in workload.requests)
        lens |= {prompts[0], prompts[len(prompts) // 2], prompts[-1]}
    elif workload.mean_prompt_len:
        lens.add(round(workload.mean_prompt_len))
    return measure(engine, list(args.contexts), sorted(lens), args.iters, args.warmup)


def run(args) -> int:
    workload = load_workload(args)
    if args.measurements:
        m = Measurements.load(args.measurements)
    else:
        m = _measure(args, workload)
    if args.save_measurements:
        m.save(args.save_measurements)
        print(f"measurements saved to {args.save_measurements}")
    cost = CostModel(m, *parse_overhead(args.host_overhead_ms))
    result = advise(cost, workload, args.graph_memory_budget, args.min_gain)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sizes_path = out / SIZES_FILE
    sizes_path.unlink(missing_ok=True)  # never leave an older run's sizes beside this report
    if result.recommended.sizes:
        sizes_path.write_text(f"# ostinato advise for {m.model} on {m.device}, workload: {workload.name}\n"
                              + " ".join(str(s) for s in result.recommended.sizes) + "\n")
    print(render(cost, result))
    # the limits the estimate assumed, then the graph flags it recommends
    command = (f"ostinato serve {args.model} --max-model-len {m.max_model_len} --max-num-seqs {m.max_num_seqs} "
               + (f"--cuda-graph-sizes @{sizes_path}" if result.enable else "--enforce-eager"))
    print(f"\nrun it with:\n  {command}")
    if not args.no_plots:
        try:
            from ostinato.tools.advise.plots import write_plots
        except ImportError as e:
            print(f"(no plots: {e}; pip install matplotlib)", file=sys.stderr)
        else:
            print("plots: " + ", ".join(str(p) for p in write_plots(cost, result, out)))
    if args.json:
        Path(args.json).write_text(json.dumps(to_json(m, result, command), indent=1) + "\n")
        print(f"report written to {args.json}")
    return 0


def render(cost: CostModel, a: Advice) -> str:
    m = cost.m
    weights = f", weights {m.quantization} {m.weights_bytes / 1e9:.2f} GB" if m.weights_bytes else ""
    lines = [f"ostinato advise: {m.model} on {m.device} ({m.dtype}{weights}, torch {m.torch_version})",
             f"workload: {a.workload}", "", "decode step, measured (ms): eager / graph = speedup"]
    lines.append(f"{'batch':>6} " + " ".join(f"{'ctx ' + str(c):>22}" for c in m.contexts))
    for j, b in enumerate(m.batch_sizes):
        cells = [f"{e[j]:7.3f} / {g[j]:6.3f} = {e[j] / g[j]:4.2f}" for e, g in zip(m.eager_ms, m.graph_ms)]
        lines.append(f"{b:>6} " + " ".join(f"{c:>22}" for c in cells))
    lines.append("prefill (ms): " + ", ".join(f"{n} tok {t:.2f}" for n, t in zip(m.prefill_lens, m.prefill_ms)))
    lines += ["", "end-to-end estimate:",
              f"{'config':<14} {'sizes':>5} {'graph MiB':>9} {'KV blocks':>9} {'seqs@max':>8} {'total s':>8} "
              f"{'out tok/s':>9} {'prefill':>7} {'steps':>7} {'mean bs':>7} {'padding':>7} {'eager st':>8}"]
    for e in (a.eager, a.default, a.recommended):
        lines.append(f"{e.name:<14} {len(e.sizes):>5} {e.graph_bytes / 2**20:>9.1f} {e.kv_blocks:>9} "
                     f"{e.max_len_seqs:>8} {e.total_s:>8.2f} {e.tokens_per_s:>9.0f} "
                     f"{e.prefill_s / e.total_s if e.total_s else 0:>7.0%} {e.decode_steps:>7.0f} "
                     f"{e.mean_batch:>7.1f} {e.padding_fraction:>7.1%} {e.eager_steps:>8.0f}")
    lines.append(f"recommended sizes: {' '.join(map(str, a.recommended.sizes)) or '(none)'} "
                 f"(memory budget {a.budget_bytes / 2**20:.0f} MiB)")
    lines += ["", "assumptions:"] + [f"  - {s}" for s in a.notes + a.assumptions] + ["", "verdict: " + a.verdict]
    return "\n".join(lines)


def _estimate_json(e: Estimate) -> dict:
    d = asdict(e)
    d["steps_by_batch"] = {str(k): v for k, v in sorted(e.steps_by_batch.items())}
    d.update(tokens_per_s=e.tokens_per_s, mean_batch=e.mean_batch, padding_fraction=e.padding_fraction)
    return d


def to_json(m: Measurements, a: Advice, command: str) -> dict:
    return {"measurements": m.to_json(), "workload": a.workload, "enable_graphs": a.enable, "gain": a.gain,
            "recommended_sizes": list(a.recommended.sizes), "budget_bytes": a.budget_bytes, "verdict": a.verdict,
            "command": command, "notes": list(a.notes), "assumptions": list(a.assumptions),
            "estimates": {e.name: _estimate_json(e) for e in (a.eager, a.default, a.recommended)}}
