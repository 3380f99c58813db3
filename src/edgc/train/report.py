"""`edgc report`: overlay finished runs in plots and compare them in one table."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from edgc.train.blocks import load_block_losses
from edgc.train.plots import plot_runs
from edgc.train.summary import RunSummary, load_run, memory_table, summarize, table

__all__ = ["report"]


def report(run_dirs: Sequence[str | Path], out_dir: str | Path) -> list[RunSummary]:
    """Write report.md and overlay plots into out_dir; returns the runs' summaries, in the
    order of its table."""
    if not run_dirs:
        raise ValueError("report needs at least one run folder")
    loaded, blocks = [], []
    for d in run_dirs:
        config, records = load_run(d)
        loaded.append((Path(d).name, config, records))
        last = [r["step"] for r in records if r.get("kind") == "val"]
        blocks.append(load_block_losses(d, last[-1]) if last else None)
    names = [n for n, _, _ in loaded]
    if len(set(names)) != len(names):  # same folder names in different places: use the paths
        loaded = [(str(d), c, r) for d, (_, c, r) in zip(run_dirs, loaded, strict=True)]
    summaries = [summarize(n, c, r, b) for (n, c, r), b in zip(loaded, blocks, strict=True)]
    text = table(summaries)
    out_dir = Path(out_dir)
    plot_runs([(n, r) for n, _, r in loaded], out_dir)
    (out_dir / "report.md").write_text(
        "# edgc report\n\n" + text
        + "\nBytes are per replica, as handed to collectives. Step time leaves out the first 5% of steps. "
        "The validation loss comes with its standard error over the evaluation blocks; \"within SE\" marks a "
        "difference from the first run no larger than its standard error, i.e. not shown to be real: the SE of "
        "the per-block differences (\"paired\") where both runs kept their block losses (val_blocks.npz), else "
        "the two runs' combined standard error (sqrt(SE1^2 + SE2^2)), which overstates it. Either is the "
        "evaluation's noise: a run with another seed adds its own.\n\n"
        + memory_table(loaded)
        + "![loss](loss.png)\n![entropy](entropy.png)\n![rank](rank.png)\n![bytes](bytes.png)\n"
    )
    return summaries
