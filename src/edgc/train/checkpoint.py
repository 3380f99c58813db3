"""Checkpoints: written atomically by rank 0, holding every replica's compression state."""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from edgc.data.atomic import atomic_write

FORMAT = "edgc-checkpoint"
VERSION = 1
CHECKPOINT_NAME = "checkpoint.pt"

__all__ = ["CHECKPOINT_NAME", "check_compatible", "load_checkpoint", "save_checkpoint"]


def save_checkpoint(path: str | Path, payload: dict[str, Any]) -> None:
    """Write payload (plus format marker) to `path` atomically: temp file, fsync, rename."""
    buf = io.BytesIO()
    torch.save({"format": FORMAT, "version": VERSION, **payload}, buf)
    with atomic_write(path) as f:
        f.write(buf.getbuffer())


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint; raises FileNotFoundError or ValueError with what is wrong."""
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {str(path)!r}; a run folder holds {CHECKPOINT_NAME} once "
                                f"it has reached its first checkpoint step")
    try:
        data = torch.load(path, map_location="cpu", weights_only=False)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError, OSError) as exc:
        raise ValueError(f"checkpoint {str(path)!r} is corrupt or truncated ({type(exc).__name__}: {exc}); "
                         f"it cannot be resumed") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} is not an edgc training checkpoint")
    if data.get("version") != VERSION:
        raise ValueError(f"checkpoint {str(path)!r} has version {data.get('version')}, this edgc reads {VERSION}")
    return data


def check_compatible(ckpt: dict[str, Any], *, world_size: int, preset: str, method: str, model_config: dict,
                     layout: tuple[int, int] | None = None) -> None:
    """Raise ValueError if a checkpoint cannot continue in this job, saying which setting differs.

    `layout` is (pp, dp); None means no pipeline, (1, world_size).
    """
    saved = ckpt["train"]
    problems = []
    if ckpt["world_size"] != world_size:
        problems.append(f"world size: checkpoint {ckpt['world_size']}, this job {world_size}")
    saved_layout = tuple(ckpt.get("layout", (1, ckpt["world_size"])))
    layout = tuple(layout) if layout is not None else (1, world_size)
    if saved_layout != layout:
        problems.append(f"layout: checkpoint pp={saved_layout[0]} x dp={saved_layout[1]}, "
                        f"this job pp={layout[0]} x dp={layout[1]}")
    if saved["preset"] != preset or ckpt["model_config"] != model_config:
        problems.append(f"model: checkpoint {saved['preset']} {ckpt['model_config']}, this job {preset} {model_config}")
    if saved["method"] != method:
        problems.append(f"method: checkpoint {saved['method']!r}, this job {method!r}")
    if problems:
        raise ValueError("checkpoint does not match this run: " + "; ".join(problems))
