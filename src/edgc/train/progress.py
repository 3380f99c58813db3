"""Live progress on rank 0: a rich progress bar, or a plain line per eval when not a terminal.

rich is imported by the display that shows something (rank 0's), so that the other
workers start without it."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress

__all__ = ["ProgressDisplay"]


class ProgressDisplay:
    """Shows step, loss, rank, phase, compression ratio and ETA while training runs."""

    def __init__(self, total: int, start: int, enabled: bool) -> None:
        self.enabled = enabled
        self.total = total
        self.interactive = enabled and sys.stderr.isatty()
        self.console: Console | None = None
        self.progress: Progress | None = None
        self.val_loss: float | None = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.console = Console(stderr=True)
        if self.interactive:
            self.progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                console=self.console,
            )
            self.task = self.progress.add_task("train", total=total, completed=start, info="")
            self.progress.start()

    def update(self, step: int, record: dict[str, Any], stats: Any, val_loss: float | None) -> None:
        if not self.enabled:
            return
        if val_loss is not None:
            self.val_loss = val_loss
        ratio = stats.bytes_uncompressed / stats.bytes_sent if stats.bytes_sent else 1.0
        info = (f"loss {record['loss']:.3f}"
                + (f" val {self.val_loss:.3f}" if self.val_loss is not None else "")
                + f" | {record['phase']} rank {_ranks(record)} | {ratio:.1f}x fewer bytes")
        if self.progress is not None:
            self.progress.update(self.task, completed=step, info=info)
        elif self.console is not None and (val_loss is not None or step == self.total):
            self.console.print(f"step {step}/{self.total} {info}", highlight=False)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def _ranks(record: dict[str, Any]) -> str:
    """The rank, or each pipeline stage's (u = uncompressed by DAC), e.g. "16/u"."""
    stages = record.get("stage_rank")
    if not stages or record["phase"] != "compress":
        return str(record["rank"])
    return "/".join(str(r) if r else "u" for r in stages)
