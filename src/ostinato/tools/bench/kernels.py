"""`ostinato bench kernels MODEL`: where a decode step's GPU time goes, per kernel class.

For each batch size, B sequences sit at `--context` tokens (the decode rows of `ostinato bench`). The
engine's decode step is launched eagerly under torch.profiler for `--steps` steps: these are the kernels
the graph replays. Each CUDA kernel's device time is summed into its class (by kernel name) and divided by
the steps. Beside it, the graph replay of the same step, measured in the same run: "share" is a class's
time over the replay, and the replay minus the kernel sum is the gap between dependent kernels.

Bytes per class, where the class has a clear count: attention reads the K and V of every context token
(all layers); the KV write moves one token's K and V per row; projections read every weight once as the model
holds it (bf16, FP8 or GGUF blocks), the lm_head included. GB/s = bytes / time, and its share of the measured
HBM read bandwidth.
Writes a JSON report and a PNG bar chart (`--output-json`, `--plot`).
"""

from __future__ import annotations

import json
from collections import defaultdict

from ostinato.runner.memory import kv_token_bytes
from ostinato.tools.bench.ceilings import engine_ceilings
from ostinato.tools.bench.decode import replay_ms, rows_loaded, weights_read_per_step

# (class, name fragments): the first class with a fragment in the kernel's name (lower case) wins.
KERNEL_CLASSES = (
    ("attention", ("_decode_split_kernel",)),
    ("kv write", ("_write_kv_kernel",)),
    ("projections", ("_gemv_kernel", "_skinny_kernel", "_fp8_mma_kernel", "_fp8_stream_kernel", "_w8a8_kernel",
                     "_gguf_kernel", "_gguf_mma_kernel", "_q4k_one_row_kernel", "_q4k_rows_kernel",
                     "_q4k_then_q6k_kernel", "_q6k_row_kernel", "_q80_row_kernel", "gemm", "gemv", "nvjet", "cutlass",
                     "xmma", "splitk", "cublas")),
    ("gguf slices dequantized for cuBLAS", ("_gguf_dequant_kernel",)),
    ("fp8 activation quantization", ("_quantize_tokens_kernel",)),
    ("gguf int8 activation quantization", ("_quantize_x_kernel", "_norm_quantize_x_kernel")),
    ("norms", ("_rms_norm_kernel",)),
    ("q/k norm + rope", ("_qk_norm_rope_kernel",)),
    ("silu * up", ("_silu_and_mul_kernel",)),
    ("sampling", ("_sample_chunk_kernel", "_sample_pick_kernel", "_penalties_kernel")),
)
OTHER = "other (embedding, row unpacking, copies)"


def classify(kernel_name: str) -> str:
    lower = kernel_name.lower()
    for cls, fragments in KERNEL_CLASSES:
        if any(f in lower for f in fragments):
            return cls
    return OTHER


def class_bytes(mc, kv_itemsize: int, batch: int, context: int, weights_read: int) -> dict[str, int]:
    """Bytes each class must move per step (its floor), for the classes with a clear count. The projections read
    the weights as the model holds them (`weights_read`, bench.decode.weights_read_per_step): FP8 or GGUF blocks
    where the model keeps them, so their HBM share is of the format's own bytes."""
    kv_per_token = kv_token_bytes(mc, kv_itemsize)
    return {
        "attention": batch * (context + 1) * kv_per_token,
        "kv write": batch * kv_per_token,
        "projections": weights_read,
    }


def register(sub) -> None:
    from ostinato.cli_args import int_list, add_engine_args

    p = sub.add_parser("bench-kernels", help="decode-step GPU time per kernel class (torch.profiler)")
    add_engine_args(p)
    p.add_argument("--batch-sizes", type=int_list, default=(1, 16, 64))
    p.add_argument("--context", type=int, default=512, help="tokens already in each sequence's cache")
    p.add_argument("--steps", type=int, default=5, help="profiled eager steps per batch size")
    p.add_argument("--iters", type=int, default=50, help="timed graph replays per batch size")
    p.add_argument("--top", type=int, default=5, help="print this many of the longest kernels per batch size "
                   "(the JSON keeps 15)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="PNG path for the kernel-breakdown bar chart")
    p.set_defaults(func=run)


def profile_step(runner, batch: int, context: int, steps: int, gen) -> dict[str, dict[str, float]]:
    """kernel name -> {"us": device µs per step, "calls": launches per step} over `steps` eager steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step = runner.decode_step
    with rows_loaded(runner, batch, context, gen) as decode_batch:
        rows = decode_batch.copy_to_device(batch)
        for _ in range(2):
            step(rows)  # warm-up: compilation and cuBLAS handles outside the profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step(rows)
            torch.cuda.synchronize()
    kernels: dict[str, dict[str, float]] = defaultdict(lambda: {"us": 0.0, "calls": 0.0})
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[event.name]
            k["us"] += event.time_range.elapsed_us() / steps
            k["calls"] += 1 / steps
    return dict(kernels)


def summarize(kernels: dict[str, dict[str, float]], nbytes: dict[str, int], replay_us: float | None,
              read_bytes_per_s: float) -> dict:
    """Per class: µs, kernels, bytes, GB/s, share of the measured read bandwidth, share of the replay; plus the
    totals and the gap."""
    classes: dict[str, dict] = {}
    for name, k in kernels.items():
        c = classes.setdefault(classify(name), {"us": 0.0, "kernels": 0.0})
        c["us"] += k["us"]
        c["kernels"] += k["calls"]
    for name, c in classes.items():
        b = nbytes.get(name)
        c["bytes"] = b
        c["GBps"] = b / c["us"] / 1e3 if b and c["us"] else None
        c["hbm_share"] = b / (c["us"] * 1e-6) / read_bytes_per_s if b and c["us"] else None
        c["share_of_replay"] = c["us"] / replay_us if replay_us else None
    total = sum(c["us"] for c in classes.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1]["us"])[:15]
    return {"classes": classes, "kernel_us": total, "kernels_per_step": sum(c["kernels"] for c in classes.values()),
            "replay_us": replay_us, "gap_us": replay_us - total if replay_us else None,
            "top_kernels": [{"name": n[:120], "class": classify(n), **k} for n, k in top]}


def report_lines(batch: int, summary: dict, top: int) -> list[str]:
    """What `bench kernels` prints for one batch size: the totals, a line per class (longest first), then
    the `top` longest kernels by name."""
    lines = [f"batch {batch}: replay {_fmt(summary['replay_us'])} us, kernels {summary['kernel_us']:.0f} us "
             f"({summary['kernels_per_step']:.0f} per step), gap {_fmt(summary['gap_us'])} us"]
    for name, c in sorted(summary["classes"].items(), key=lambda kv: -kv[1]["us"]):
        bw = f"{c['GBps']:6.0f} GB/s ({100 * c['hbm_share']:4.1f}% HBM)" if c["GBps"] else " " * 24
        share = f"{100 * c['share_of_replay']:5.1f}%" if c["share_of_replay"] else "   -  "
        lines.append(f"  {name:40s} {c['us']:8.1f} us  {c['kernels']:5.0f} kernels  {bw}  {share} of replay")
    if top > 0:
        lines.append("  longest kernels:")
        lines += [f"    {k['us']:8.1f} us  {k['calls']:5.0f} calls  {k['name'][:90]}"
                  for k in summary["top_kernels"][:top]]
    return lines


def run(args) -> int:
    import torch

    from ostinato.cli_args import engine_args_from
    from ostinato.engine.engine import LLMEngine
    from ostinato.tools.bench import plots as bench_plots

    if not torch.cuda.is_available():
        print("error: `ostinato bench kernels` profiles CUDA kernels; it needs a CUDA GPU")
        return 2
    engine_args = engine_args_from(args)
    ceilings = engine_ceilings(engine_args)  # before the model takes the memory
    engine = LLMEngine(engine_args)
    runner = engine.runner
    gen = torch.Generator().manual_seed(0)
    report = {"model": args.model, "dtype": str(runner.dtype), "context": args.context, "torch": torch.__version__,
              "device": ceilings.device, "read_bytes_per_s": ceilings.read_bytes_per_s,
              "graph_status": engine.graph_status, "batches": []}
    print(f"HBM shares of {ceilings.describe()}")
    weights_read = weights_read_per_step(runner)
    with torch.inference_mode():
        for bs in args.batch_sizes:
            _, graph_ms = replay_ms(runner, bs, args.context, gen, args.iters, 10)
            kernels = profile_step(runner, bs, args.context, args.steps, gen)
            nbytes = class_bytes(runner.model_config, runner.kv_dtype.itemsize, bs, args.context, weights_read)
            summary = summarize(kernels, nbytes, graph_ms * 1e3 if graph_ms else None, ceilings.read_bytes_per_s)
            report["batches"].append({"batch": bs, **summary})
            print("\n".join(report_lines(bs, summary, args.top)))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        batches = [b["batch"] for b in report["batches"]]
        names = sorted({n for b in report["batches"] for n in b["classes"]},
                       key=lambda n: -sum(b["classes"].get(n, {"us": 0})["us"] for b in report["batches"]))
        classes = {n: [b["classes"].get(n, {"us": 0.0})["us"] for b in report["batches"]] for n in names}
        bench_plots.kernel_breakdown(batches, classes, [b["replay_us"] for b in report["batches"]],
                                     f"decode step by kernel class, context {args.context}\n{args.model}", args.plot)
        print(f"wrote {args.plot}")
    return 0


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.0f}"
