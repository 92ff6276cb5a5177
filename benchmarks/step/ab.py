"""Whole decode steps of two or more variants, alternated in one call: `ostinato bench` once per variant per round,
each in its own process, then each variant's step at each batch size beside the first variant's.

Why: a setting is chosen here by whole steps, not by a kernel alone (docs/PERFORMANCE.md says where the two
disagreed), and two runs of one build differ by a percent or so from one start to the next; alternating the
variants, round after round on one warm GPU, puts that spread beside the difference. A variant is bench flags
(`--decode-tuning '{"splits": 8}'`, `--quantization fp8`, ...), a source tree (`@DIR`: DIR's `ostinato`
package first on the path, e.g. a copy of src/ with one change), or both (`@DIR FLAGS`).

    PYTHONPATH=src python3 benchmarks/step/ab.py MODEL --rounds 2 \\
        --common "--max-model-len 2048 --gpu-memory-utilization 0.6 --no-hf --context 512 --cuda-graph-sizes '1 8' \\
                  --batch-sizes '1 8'" \\
        --variant main= --variant "apart=--decode-tuning '{\"quantize_output\": false}'"

FLAGS and --common are split as a shell splits words, so a flag's value with spaces or quotes (JSON) goes in
quotes inside the variant's string, as above.

Prints each run's graph step (ms; eager where there is no graph) as it ends, then per variant and batch size the
runs and their median, and the median over the first variant's. `--output-json PATH` keeps every run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Variant:
    """One side of the comparison: a name, bench flags, and the source tree its `ostinato` comes from (None: the
    one on the caller's path)."""

    name: str
    flags: tuple[str, ...]
    tree: str | None = None


@dataclass
class Runs:
    """Each variant's step times by batch size, one per round: {variant: {batch: [ms, ...]}}."""

    steps: dict[str, dict[int, list[float]]] = field(default_factory=dict)

    def add(self, variant: str, rows: list[dict]) -> None:
        for row in rows:
            step = row["graph_ms"] or row["eager_ms"]
            self.steps.setdefault(variant, {}).setdefault(row["batch"], []).append(step)

    def table(self) -> list[str]:
        """A line per variant and batch size: the runs, their median, and the median over the first variant's."""
        if not self.steps:
            return []
        first = next(iter(self.steps.values()))
        lines = [f"{'variant':24s} {'batch':>5s} {'median ms':>9s} {'x first':>7s}  runs"]
        for name, by_batch in self.steps.items():
            for batch, runs in sorted(by_batch.items()):
                median = statistics.median(runs)
                base = statistics.median(first[batch]) if batch in first else float("nan")
                lines.append(f"{name:24s} {batch:5d} {median:9.3f} {median / base:7.3f}  "
                             + " / ".join(f"{r:.3f}" for r in runs))
        return lines


def parse_variant(text: str) -> Variant:
    """NAME=FLAGS, NAME=@DIR or NAME=@DIR FLAGS -> a Variant (FLAGS split as a shell would)."""
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"a variant is NAME=FLAGS, NAME=@DIR or NAME=@DIR FLAGS, got {text!r}")
    words = shlex.split(rest)
    tree = None
    if words and words[0].startswith("@"):
        tree = words.pop(0)[1:]
        if not (Path(tree) / "ostinato").is_dir():
            raise argparse.ArgumentTypeError(f"variant {name}: {tree} holds no ostinato package (give the src/ "
                                             "folder of a tree)")
    return Variant(name, tuple(words), tree)


def bench_command(model: str, common: list[str], variant: Variant, output_json: str) -> list[str]:
    return [sys.executable, "-m", "ostinato", "bench", model, *common, *variant.flags, "--output-json", output_json]


def variant_env(variant: Variant) -> dict[str, str]:
    """The caller's environment, with the variant's tree first on PYTHONPATH."""
    env = dict(os.environ)
    if variant.tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.abspath(variant.tree), env.get("PYTHONPATH")) if p)
    return env


def run_once(model: str, common: list[str], variant: Variant, timeout: float) -> dict:
    """One `ostinato bench` of the variant: its JSON report. Raises with the run's last output if it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        done = subprocess.run(bench_command(model, common, variant, out), env=variant_env(variant),
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0 or not os.path.exists(out):
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-5:])
            raise RuntimeError(f"variant {variant.name}: bench exited {done.returncode}\n{tail}")
        return json.loads(Path(out).read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--variant", type=parse_variant, action="append", required=True,
                    help="NAME=FLAGS, NAME=@DIR or NAME=@DIR FLAGS (at least two; the first is the baseline)")
    ap.add_argument("--common", default="", help="bench flags every variant takes, as one string")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=590.0, help="seconds one bench may take")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    if len(args.variant) < 2 or len({v.name for v in args.variant}) != len(args.variant):
        ap.error("give at least two variants, each its own name")
    common = shlex.split(args.common)
    runs, reports = Runs(), []
    for r in range(args.rounds):
        for variant in args.variant:
            report = run_once(args.model, common, variant, args.timeout)
            runs.add(variant.name, report["rows"])
            reports.append({"round": r, "variant": variant.name, "report": report})
            steps = ", ".join(f"{row['batch']}: {row['graph_ms'] or row['eager_ms']:.3f}" for row in report["rows"])
            print(f"round {r} {variant.name}: {steps} ms", flush=True)
    print("\n".join(runs.table()))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(reports, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
