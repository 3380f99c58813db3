"""The validation set and its loss: a fixed set of blocks, a mean and its standard error.

Both trainers (data-parallel and pipeline) evaluate the same way:

1. **The blocks.** The validation tokens are cut into non-overlapping blocks of
   block_size inputs (plus the one next target), on a grid from offset 0. With at most
   `eval_tokens` to use, the blocks are spread evenly over the whole split (every k-th
   grid block), so a cap samples every part of it rather than its first files. The set
   depends only on the token file, block_size and eval_tokens: every run on the same data
   is evaluated on the same blocks, so two methods' losses are paired, and so are two
   evaluations of one run.
2. **Sharing out.** Block i goes to data-parallel replica i mod dp; each replica runs its
   blocks in batches of batch_size, the last one padded with copies of its first block
   whose losses are left out (a pipeline's schedule needs full batches).
3. **The statistics.** Each block's loss is its mean token cross-entropy. The sum, the
   sum of squares and the count of the block losses are summed over all ranks in float64;
   the loss is their mean and its standard error is the blocks' sample standard deviation
   over sqrt(count). Blocks of one file are correlated, so this SE is a lower bound on the
   spread one would see over other validation files; it measures the noise of the
   evaluation itself, which is what a comparison on the same blocks needs.
4. **Each block's loss.** The block losses themselves are gathered too (one float64 a
   block, summed over all ranks into their places), so that two runs on the same blocks
   can be compared block by block: the SE of a paired difference is that of the
   per-block differences, far smaller than the two losses' combined SE when the runs'
   errors move together, as they do on the same blocks. The trainers keep every
   evaluation's in the run folder's `val_blocks.npz` (`write_evaluation`; the file, its
   reading and the paired difference are edgc.train.blocks').

Before this, evaluation used 8 random batches (8,192 tokens), and the same checkpoint's
loss moved from 3.543 to 3.614 +- 0.076 over 64 random batches (issue 10).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from edgc.data import TokenFile
from edgc.train.blocks import save_block_losses
from edgc.train.metrics import MetricsWriter, perplexity

__all__ = ["EvalBatch", "EvalResult", "LossMoments", "block_losses", "eval_batches", "eval_starts", "val_record",
           "write_evaluation"]

@dataclass(frozen=True)
class EvalResult:
    """One evaluation's figures, the same on every rank."""

    loss: float
    """Mean of the block losses (nats per token)."""

    se: float
    """Standard error of that mean: sample std of the block losses / sqrt(blocks); NaN
    with fewer than two blocks."""

    blocks: int
    """Blocks evaluated (over all ranks)."""

    tokens: int
    """Target tokens evaluated: blocks * block_size."""

    seconds: float
    """Wall time of the evaluation on this rank, the final all-reduce included."""

    losses: np.ndarray | None = field(default=None, compare=False, repr=False)
    """Each block's loss, float64 (blocks,), block i the one at `starts[i]`; None where the
    blocks were not tracked (LossMoments without `starts`)."""

    starts: np.ndarray | None = field(default=None, compare=False, repr=False)
    """The blocks' first tokens in the validation file (`eval_starts`), with `losses`."""


@dataclass(frozen=True)
class EvalBatch:
    """A batch of evaluation blocks: x and y of shape (B, T); only the first `valid` rows
    count (the rest pad the batch to full size)."""

    x: torch.Tensor
    y: torch.Tensor
    valid: int


def eval_starts(n_tokens: int, block_size: int, max_tokens: int | None = None) -> np.ndarray:
    """Start offsets of the evaluation blocks in a token file of `n_tokens` ids.

    Grid block k covers inputs [k*T, (k+1)*T) and targets one further, so there are
    (n_tokens - 1) // T of them. With `max_tokens`, at most max(1, max_tokens // T) of them
    are used, spread evenly over the grid. Returns an int64 array, ascending. Raises
    ValueError if not even one block fits.
    """
    available = (n_tokens - 1) // block_size
    if available < 1:
        raise ValueError(
            f"the validation split has {n_tokens} tokens, fewer than block_size + 1 = {block_size + 1}: "
            f"not one evaluation block; give more validation text or a shorter block_size"
        )
    n = available if max_tokens is None else min(available, max(1, max_tokens // block_size))
    grid = (np.arange(n, dtype=np.int64) * available) // n  # (n,): distinct, ascending, spread over the grid
    return grid * block_size


def eval_batches(
    val: TokenFile | np.ndarray,
    starts: np.ndarray,
    block_size: int,
    batch_size: int,
    device: torch.device,
) -> Iterator[EvalBatch]:
    """Yields the blocks of `block_size` inputs at `starts`, in order, `batch_size` at a
    time; the last batch is padded to full size with copies of its first block (see
    `EvalBatch.valid`). Reads the ids from `val`; changes nothing."""
    data = val.tokens if isinstance(val, TokenFile) else val
    for lo in range(0, len(starts), batch_size):
        chunk = [int(s) for s in starts[lo : lo + batch_size]]
        valid = len(chunk)
        chunk += [chunk[0]] * (batch_size - valid)
        windows = np.stack([data[s : s + block_size + 1] for s in chunk])  # (B, T+1)
        buf = torch.from_numpy(windows.astype(np.int64))  # (B, T+1)
        x = buf[:, :-1].contiguous().to(device)  # (B, T)
        y = buf[:, 1:].contiguous().to(device)  # (B, T)
        yield EvalBatch(x=x, y=y, valid=valid)


def block_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each block's mean token cross-entropy: logits (B, T, V) (any float dtype; computed
    in float32) and targets (B, T) -> float64 (B,)."""
    B, T, V = logits.shape
    per_token = F.cross_entropy(logits.float().reshape(B * T, V), targets.reshape(B * T), reduction="none")
    return per_token.view(B, T).double().mean(dim=1)  # (B,)


class LossMoments:
    """Running sum, sum of squares and count of block losses on one rank, in float64;
    `result` sums them over all ranks and returns the mean and its standard error.

    With `starts` (the evaluation's blocks over all ranks, `eval_starts`), each block's loss
    is kept in its place too (`add`'s `index`), and `result` gathers them all."""

    def __init__(self, device: torch.device, starts: np.ndarray | None = None) -> None:
        self.starts = starts
        self.blocks = 0 if starts is None else len(starts)
        # [sum, sum of squares, count, then each block's loss (blocks of them)]
        self.moments = torch.zeros(3 + self.blocks, dtype=torch.float64, device=device)
        self.start = time.perf_counter()

    def add(self, losses: torch.Tensor, index: np.ndarray | None = None) -> None:
        """Adds block losses (1-D); `index`: their block numbers (positions in
        `eval_starts`), needed when the blocks are tracked."""
        losses = losses.detach().double()
        self.moments[:3] += torch.stack([losses.sum(), losses.square().sum(),
                                         losses.new_tensor(float(losses.numel()))])
        if self.blocks:
            if index is None or len(index) != losses.numel():
                raise ValueError("LossMoments tracks each block: give the block numbers of the losses added")
            self.moments[3 + torch.as_tensor(np.asarray(index), device=losses.device)] = losses

    def result(self, block_size: int, group: dist.ProcessGroup | None = None) -> EvalResult:
        """Sums the moments (and the block losses, each counted on one rank) over `group`
        (every rank must call this) and returns the evaluation's figures. With no process
        group initialised, this rank's alone."""
        total = self.moments.clone()
        if dist.is_available() and dist.is_initialized():
            # collective (metrics only): all-reduce SUM of 3 + blocks float64
            dist.all_reduce(total, group=group)
        each = total[3:].cpu().numpy() if self.blocks else None
        s, sq, n = (float(v) for v in total[:3].tolist())
        mean = s / n if n else math.nan
        if n >= 2:
            # sample variance, (sum of squares - n * mean^2) / (n - 1); float64 holds the
            # difference well for losses of a few nats over millions of blocks
            var = max(0.0, (sq - s * s / n) / (n - 1))
            se = math.sqrt(var / n)
        else:
            se = math.nan
        return EvalResult(loss=mean, se=se, blocks=int(n), tokens=int(n) * block_size,
                          seconds=time.perf_counter() - self.start, losses=each, starts=self.starts)


def val_record(step: int, result: EvalResult) -> dict[str, float | int | str]:
    """The metrics.jsonl line of one evaluation."""
    return {
        "step": step, "kind": "val", "val_loss": result.loss, "val_loss_se": result.se,
        # (a diverged model's loss overflows exp; the writer logs inf and nan as null)
        "val_ppl": perplexity(result.loss), "val_tokens": result.tokens, "val_time": result.seconds,
    }


def write_evaluation(writer: MetricsWriter, step: int, result: EvalResult, *, folder: str | Path) -> None:
    """Logs one evaluation's metrics line (`val_record`) and keeps each block's loss in
    the run `folder` (`save_block_losses`). Rank 0's, which holds the writer."""
    writer.write(val_record(step, result))
    if result.losses is not None and result.starts is not None:
        save_block_losses(folder, step, result.starts, result.losses)
