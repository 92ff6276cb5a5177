"""PNG charts of the bench commands (matplotlib, Agg backend: no display needed).

latency_vs_batch    ms per decode step against batch size, one line per series, the floor dashed.
kernel_breakdown    µs per kernel class, one stacked bar per batch size, the replay time marked.
bars                one bar per named figure (peers, throughput), with an optional floor line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def latency_vs_batch(batches: Sequence[int], series: Mapping[str, Sequence[float | None]],
                     floor: Sequence[float], title: str, path: str | Path) -> Path:
    """series: name -> ms per batch (None where not measured); floor: ms per batch."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, values in series.items():
        points = [(b, v) for b, v in zip(batches, values) if v is not None]
        if points:
            ax.plot(*zip(*points), marker="o", label=name)
    ax.plot(batches, floor, "k--", lw=1, label="bandwidth floor")
    ax.set(xlabel="decode batch size", ylabel="ms per decode step", title=title)
    ax.set_ylim(bottom=0)
    ax.legend()
    return _save(fig, path)


def kernel_breakdown(batches: Sequence[int], classes: Mapping[str, Sequence[float]],
                     replay_us: Sequence[float | None], title: str, path: str | Path) -> Path:
    """classes: kernel class -> µs per batch (stacked); replay_us: the graph replay per batch (a marker)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels = [str(b) for b in batches]
    bottom = [0.0] * len(batches)
    for name, values in classes.items():
        ax.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    marks = [(label, r) for label, r in zip(labels, replay_us) if r is not None]
    if marks:
        ax.plot(*zip(*marks), "k_", ms=40, mew=2, label="graph replay")
    ax.set(xlabel="decode batch size", ylabel="µs per decode step", title=title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def bars(values: Mapping[str, float | None], ylabel: str, title: str, path: str | Path,
         floor: float | None = None, log: bool = False) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    shown = {k: v for k, v in values.items() if v is not None}
    ax.bar(list(shown), list(shown.values()))
    for i, v in enumerate(shown.values()):
        ax.annotate(f"{v:.3g}", (i, v), ha="center", va="bottom", fontsize=8)
    if floor is not None:
        ax.axhline(floor, color="k", ls="--", lw=1, label="bandwidth floor")
        ax.legend()
    ax.set(ylabel=ylabel, title=title)
    if log:
        ax.set_yscale("log")
    ax.tick_params(axis="x", labelsize=8)
    return _save(fig, path)
