"""A run's metrics, written by rank 0: metrics.jsonl, one JSON object per line, and with
`--log tensorboard` the same records as TensorBoard scalars in RUN/tensorboard/."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgc.train.blocks import keep_block_losses_until

if TYPE_CHECKING:
    from edgc.train.config import TrainConfig

__all__ = ["METRICS_NAME", "TENSORBOARD_DIR", "MetricsWriter", "TensorBoardWriter", "perplexity", "read_metrics",
           "record_scalars"]

METRICS_NAME = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def perplexity(loss: float) -> float:
    """exp(loss), or inf where that overflows a float (above about 709.78: a diverged
    model's loss, e.g. 5.7e5 nats after one step at --lr 100); NaN for a NaN loss."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


class MetricsWriter:
    """Appends records to `path`, each flushed as it is written, and to a TensorBoardWriter
    in the folder beside it when `tensorboard`.

    `resume_step`: None starts the metrics afresh; a step keeps what was logged up to it
    and drops the rest (those steps will run again)."""

    def __init__(self, path: str | Path, resume_step: int | None = None, tensorboard: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            # drop what was logged after the checkpoint; those steps will run again
            kept = [r for r in read_metrics(self.path) if r["step"] <= resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        elif resume_step is None:
            self.path.write_text("")
        self._board = TensorBoardWriter(self.path.parent / TENSORBOARD_DIR, resume_step) if tensorboard else None
        self._file = self.path.open("a")

    @classmethod
    def for_run(cls, cfg: TrainConfig, resume_step: int | None = None) -> MetricsWriter:
        """The writer of run `cfg`: RUN/metrics.jsonl, and RUN/tensorboard/ with --log tensorboard.
        On resume the run's block losses past `resume_step` are dropped with its records
        (edgc.train.blocks), so that neither holds an evaluation the other does not."""
        if resume_step is not None:
            keep_block_losses_until(cfg.out, resume_step)
        return cls(Path(cfg.out) / METRICS_NAME, resume_step, tensorboard=cfg.log == "tensorboard")

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        if self._board is not None:
            self._board.write(record)

    def close(self) -> None:
        self._file.close()
        if self._board is not None:
            self._board.close()


class TensorBoardWriter:
    """metrics.jsonl's records as TensorBoard scalars (`record_scalars`), in event files in
    `folder`.

    A new run (`resume_step` None) removes the folder's old event files, as metrics.jsonl
    starts afresh. A resumed run adds an event file that begins with purge_step =
    resume_step + 1: TensorBoard then drops whatever an earlier attempt logged from that
    step on, so each step shows once, with the values of the run that continued.
    Raises ValueError when the tensorboard package is missing."""

    def __init__(self, folder: str | Path, resume_step: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # (torch's writer needs the tensorboard package)
            raise ValueError("log='tensorboard': the tensorboard package is not installed; install it with: "
                             "pip install 'edgc[tensorboard]'") from None
        folder = Path(folder)
        if resume_step is None:
            for old in folder.glob("events.out.tfevents.*"):
                old.unlink()
        purge = None if resume_step is None else resume_step + 1
        self._writer = SummaryWriter(str(folder), purge_step=purge, flush_secs=10)

    def write(self, record: dict[str, Any]) -> None:
        for tag, value in record_scalars(record).items():
            self._writer.add_scalar(tag, value, record["step"])

    def close(self) -> None:
        self._writer.close()  # (flushes)


def record_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The scalars of one metrics.jsonl record, tagged "<kind>/<field>" ("train/loss",
    "train/rank", "train/bytes_sent", "val/loss": a val_ prefix is dropped), with:

    - "train/compression_ratio": bytes_uncompressed / bytes_sent of the step;
    - "train/compressing": 1 for a step sent compressed (phase "compress"), else 0;
    - a list (a pipeline's per-stage fields) as one tag per stage: "train/stage_rank/1".

    Values that are not finite (the entropy before its first estimate, a diverged loss)
    are left out, as metrics.jsonl writes them as null."""
    kind = record["kind"]
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in ("step", "kind"):
            continue
        tag = f"{kind}/{key.removeprefix(kind + '_')}"
        if key == "phase":
            out[f"{kind}/compressing"] = float(value == "compress")
        elif isinstance(value, list):
            out.update({f"{tag}/{p}": float(v) for p, v in enumerate(value)})
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[tag] = float(value)
    if record.get("bytes_sent"):
        out[f"{kind}/compression_ratio"] = record["bytes_uncompressed"] / record["bytes_sent"]
    return {tag: value for tag, value in out.items() if math.isfinite(value)}


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl; a torn last line (a killed run) is skipped."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
