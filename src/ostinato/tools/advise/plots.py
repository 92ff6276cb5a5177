"""PNG plots of an `ostinato advise` report (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import bisect
from pathlib import Path

from ostinato.tools.advise.costs import CostModel
from ostinato.tools.advise.estimate import Advice


def write_plots(cost: CostModel, advice: Advice, out_dir: Path) -> list[Path]:
    """speedup.png, graph_memory.png, padding.png in out_dir; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = cost.m
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4))
    for ctx, e_row, g_row in zip(m.contexts, m.eager_ms, m.graph_ms):
        ax.plot(m.batch_sizes, [e / g for e, g in zip(e_row, g_row)], marker=".", label=f"context {ctx}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xlabel="decode batch size", ylabel="eager time / graph replay time",
           title=f"CUDA-graph speedup of a decode step ({m.device})")
    ax.legend()
    paths.append(_save(fig, out_dir / "speedup.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    tops = list(m.default_sizes)
    ax.plot(tops, [cost.graph_bytes([s for s in m.default_sizes if s <= t]) / 2**20 for t in tops], marker=".",
            label="default sizes up to x")
    rec = advice.recommended
    if rec.sizes:
        ax.plot([max(rec.sizes)], [rec.graph_bytes / 2**20], "r*", ms=14,
                label=f"recommended ({len(rec.sizes)} sizes)")
    ax.axhline(advice.budget_bytes / 2**20, color="grey", ls="--", lw=0.8, label="memory budget")
    ax.set(xlabel="largest captured size", ylabel="graph memory (MiB)", title="Graph memory vs size set")
    ax.legend()
    paths.append(_save(fig, out_dir / "graph_memory.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    weights = advice.default.steps_by_batch
    batches = sorted(weights)
    for est, marker in ((advice.default, "o"), (advice.recommended, "x")):
        waste = []
        for n in batches:
            i = bisect.bisect_left(est.sizes, n)
            waste.append((est.sizes[i] - n) / est.sizes[i] if i < len(est.sizes) else float("nan"))
        # markers only: between two batch sizes the waste is a sawtooth, not a line
        ax.plot(batches, waste, marker=marker, ls="none",
                label=f"{est.name}: {est.padding_fraction:.1%} padded rows overall")
    ax.set(xlabel="decode batch size", ylabel="padded share of the replayed rows")
    ax.set_title(f"Padding waste\nworkload: {advice.workload}", fontsize=9)
    ax2 = ax.twinx()
    ax2.bar(batches, [weights[n] for n in batches], alpha=0.25, color="grey", width=1.0)
    ax2.set_ylabel("decode steps at this batch (default sizes)")
    ax.legend(loc="upper right")
    paths.append(_save(fig, out_dir / "padding.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
