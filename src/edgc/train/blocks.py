"""The run folder's block losses (`val_blocks.npz`): every evaluation's loss on each
validation block, so that two runs evaluated on the same blocks are compared block by block
(edgc.train.evaluation, "Each block's loss").

The file holds numpy arrays only, read without pickles: `steps` (evaluations,), the blocks'
`starts` in the validation file (blocks,), once, and `losses` (evaluations, blocks), a row
per evaluated step. Each evaluation rewrites it atomically with its row added; a resumed
run first drops the rows past its checkpoint (MetricsWriter, as metrics.jsonl drops the
records past it). The first format, which held the last evaluation's only (a scalar `step`
and 1-D `losses`), still loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgc.atomic import atomic_write

__all__ = ["BLOCKS_FILE", "BlockLosses", "block_losses_by_step", "keep_block_losses_until", "load_block_losses",
           "paired_difference", "save_block_losses"]

#: The run folder's file of every evaluation's block losses.
BLOCKS_FILE = "val_blocks.npz"


@dataclass(frozen=True)
class BlockLosses:
    """One evaluation's loss on each block, as `val_blocks.npz` holds it."""

    step: int
    """The step evaluated."""

    starts: np.ndarray
    """int64 (blocks,): each block's first token in the validation file (`eval_starts`)."""

    losses: np.ndarray
    """float64 (blocks,): each block's mean token cross-entropy."""


def save_block_losses(folder: str | Path, step: int, starts: np.ndarray, losses: np.ndarray) -> Path:
    """Adds one evaluation's block losses to `val_blocks.npz` in the run folder `folder`
    (rewritten atomically) and returns its path. The rows already there for `step` or a
    later step are dropped (a resumed run evaluating again what an earlier attempt
    evaluated past its checkpoint), and so are all of them when they are of other blocks.
    A file there that edgc did not write is replaced. Raises ValueError if starts and
    losses differ in length."""
    starts, losses = np.asarray(starts, dtype=np.int64), np.asarray(losses, dtype=np.float64)
    if starts.shape != losses.shape or starts.ndim != 1:
        raise ValueError(f"block starts {starts.shape} and losses {losses.shape} must be 1-D and of one length")
    try:
        before = list(block_losses_by_step(folder).values())
    except ValueError:  # (a file edgc did not write: replaced, not a reason to stop training)
        before = []
    kept = [b for b in before if b.step < step and np.array_equal(b.starts, starts)]
    return _write(folder, [*kept, BlockLosses(step=step, starts=starts, losses=losses)])


def keep_block_losses_until(folder: str | Path, step: int) -> None:
    """A resumed run's start: drop the rows of `val_blocks.npz` past its checkpoint's
    `step`, as metrics.jsonl drops the records past it, so that the file never holds an
    evaluation the run's metrics do not (a file edgc did not write is removed)."""
    path = Path(folder) / BLOCKS_FILE
    try:
        kept = [b for s, b in sorted(block_losses_by_step(folder).items()) if s <= step]
    except ValueError:
        kept = []
    if kept:
        _write(folder, kept)
    else:
        path.unlink(missing_ok=True)


def _write(folder: str | Path, rows: list[BlockLosses]) -> Path:
    """`val_blocks.npz` holding `rows` (evaluations of the same blocks, in step order),
    written atomically; returns its path."""
    path = Path(folder) / BLOCKS_FILE
    with atomic_write(path) as f:
        np.savez(f, steps=np.array([b.step for b in rows], dtype=np.int64), starts=rows[0].starts,
                 losses=np.stack([b.losses for b in rows]))  # (evaluations, blocks)
    return path


def block_losses_by_step(folder: str | Path) -> dict[int, BlockLosses]:
    """Every evaluation's block losses the run folder kept, by step ({} without
    `val_blocks.npz`: a run from before they were kept). A file of the first format, which
    held the last evaluation's only (`step`, 1-D `losses`), gives that one. Loads arrays
    only (no pickles); raises ValueError naming the file if it is not one edgc wrote."""
    path = Path(folder) / BLOCKS_FILE
    if not path.is_file():
        return {}
    try:
        with np.load(path, allow_pickle=False) as npz:
            starts, losses = npz["starts"], npz["losses"]
            steps = npz["steps"] if "steps" in npz.files else npz["step"].reshape(1)  # (the first format: a scalar)
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(f"{str(path)!r} is not an edgc block-loss file ({exc})") from None
    if losses.ndim == 1:  # (the first format: one evaluation)
        losses = losses[None, :]
    if (starts.ndim != 1 or steps.ndim != 1 or losses.shape != (len(steps), len(starts))
            or starts.dtype != np.int64 or steps.dtype != np.int64 or losses.dtype != np.float64):
        raise ValueError(f"{str(path)!r} is not an edgc block-loss file (steps {steps.dtype}{steps.shape}, "
                         f"starts {starts.dtype}{starts.shape}, losses {losses.dtype}{losses.shape})")
    return {int(t): BlockLosses(step=int(t), starts=starts, losses=row) for t, row in zip(steps, losses, strict=True)}


def load_block_losses(folder: str | Path, step: int | None = None) -> BlockLosses | None:
    """The run folder's block losses of the evaluation at `step` (None: its last
    evaluation's), or None if it kept none of that step (a run from before they were kept,
    or an evaluation whose blocks were not kept: they pair only with the loss of the one
    they were taken at). Raises ValueError as `block_losses_by_step`."""
    kept = block_losses_by_step(folder)
    if not kept:
        return None
    return kept[max(kept)] if step is None else kept.get(step)


def paired_difference(a: BlockLosses, b: BlockLosses) -> tuple[float, float]:
    """(mean of a's block losses minus b's, its standard error): the sample standard
    deviation of the per-block differences over sqrt(blocks). The two evaluations must be
    of the same blocks (ValueError otherwise); NaN SE with fewer than two blocks."""
    if a.starts.shape != b.starts.shape or not np.array_equal(a.starts, b.starts):
        raise ValueError(f"the two evaluations are not of the same blocks ({len(a.starts)} and {len(b.starts)} "
                         "blocks): a paired difference needs the same validation file, block_size and eval_tokens")
    d = a.losses - b.losses  # (blocks,)
    se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) >= 2 else math.nan
    return float(d.mean()), se
