"""PNG plots of runs (matplotlib, Agg backend): loss, entropy, rank and cumulative bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

__all__ = ["plot_runs"]

Run = tuple[str, list[dict[str, Any]]]  # (label, metrics records)


def _series(records: list[dict[str, Any]], kind: str, key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if r.get("kind") == kind and r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_runs(runs: list[Run], out_dir: str | Path) -> list[Path]:
    """Write loss.png, entropy.png, rank.png (per stage for pipeline runs), stages.png
    (pipeline runs only) and bytes.png for the runs; returns the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, recs in runs:
        s, v = _series(recs, "train", "loss")
        line, = ax.plot(s, v, alpha=0.5, lw=1, label=f"{label} train")
        s, v = _series(recs, "val", "val_loss")
        ax.plot(s, v, "o-", color=line.get_color(), lw=2, label=f"{label} validation")
    ax.set(xlabel="step", ylabel="cross-entropy loss", title="Loss")
    paths.append(_save(fig, ax, out_dir / "loss.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, recs in runs:
        s, v = _series(recs, "train", "entropy")
        if v:
            ax.plot(s, v, ".-", ms=3, lw=1, label=label)
    ax.set(xlabel="step", ylabel="entropy estimate (nats)", title="Gradient entropy (GDS samples)")
    paths.append(_save(fig, ax, out_dir / "entropy.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, recs in runs:
        stages = _stage_series(recs, "stage_rank")
        if stages:  # a pipeline run: one line per stage
            for p, (s, v) in enumerate(stages):
                ax.step(s, v, where="post", label=f"{label} stage {p}")
        else:
            s, v = _series(recs, "train", "rank")
            experts = _series(recs, "train", "expert_rank")
            ax.step(s, v, where="post", label=f"{label} dense" if experts[1] else label)
            if experts[1]:  # (experts with a core of their own: their rank beside the dense one)
                ax.step(*experts, where="post", linestyle="--", label=f"{label} experts")
    ax.set(xlabel="step", ylabel="rank (0 = uncompressed)", title="Compression rank")
    paths.append(_save(fig, ax, out_dir / "rank.png"))

    if any(_stage_series(recs, "stage_sync_end") for _, recs in runs):
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, recs in runs:
            for p, (s, v) in enumerate(_stage_series(recs, "stage_sync_end")):
                ax.plot(s, _rolling_mean([x * 1e3 for x in v], 10), lw=1.2, label=f"{label} stage {p}")
        ax.set(xlabel="step", ylabel="ms from the step's start (mean of 10 steps)",
               title="When each pipeline stage's gradient sync ends")
        paths.append(_save(fig, ax, out_dir / "stages.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    drawn_reference = False
    for label, recs in runs:
        s, sent = _series(recs, "train", "bytes_sent")
        _, full = _series(recs, "train", "bytes_uncompressed")
        ax.plot(s, _cumsum_mb(sent), label=f"{label} sent")
        if not drawn_reference and full:
            ax.plot(s, _cumsum_mb(full), "k--", label="uncompressed all-reduce")
            drawn_reference = True
    ax.set(xlabel="step", ylabel="cumulative MB per replica", title="Bytes handed to collectives")
    paths.append(_save(fig, ax, out_dir / "bytes.png"))
    return paths


def _stage_series(records: list[dict[str, Any]], key: str) -> list[tuple[list[int], list[float]]]:
    """Per pipeline stage (step, value) series of a per-stage list field; [] if absent."""
    train = [r for r in records if r.get("kind") == "train" and r.get(key)]
    if not train:
        return []
    stages = len(train[0][key])
    return [([r["step"] for r in train], [r[key][p] for r in train]) for p in range(stages)]


def _rolling_mean(values: list[float], n: int) -> list[float]:
    """Mean of each value with up to n - 1 before it."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= n:
            total -= values[i - n]
        out.append(total / min(i + 1, n))
    return out


def _cumsum_mb(values: list[float]) -> list[float]:
    total, out = 0.0, []
    for v in values:
        total += v
        out.append(total / 1e6)
    return out


def _save(fig: Any, ax: Any, path: Path) -> Path:
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
