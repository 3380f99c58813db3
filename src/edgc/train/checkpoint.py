"""Checkpoints: written atomically by rank 0, holding every replica's compression state.

A checkpoint is torch.save's zip archive, whose every record carries a CRC-32 of its
bytes; `load_checkpoint` verifies them all before trusting the file, so a flipped byte
in the tensor data is an error, not a NaN loss some steps later. `save_checkpoint(...,
keep=K)` also keeps the last K checkpoints as `checkpoint-STEP.pt` (hard links: no extra
disk for the newest); `checkpoint.pt` is always the newest. Only tensors and plain values
are loaded (edgc.safeload): a checkpoint that names code to run is refused unless trusted.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from edgc.atomic import atomic_write
from edgc.checkpoint import is_torch_archive, verify_checksums
from edgc.models.gpt2 import GPTConfig
from edgc.safeload import UnsafeFileError, load_torch

FORMAT = "edgc-checkpoint"
VERSION = 1
CHECKPOINT_NAME = "checkpoint.pt"

__all__ = ["CHECKPOINT_NAME", "check_compatible", "kept_checkpoints", "load_checkpoint", "save_checkpoint", "saved_tp"]

_KEPT = re.compile(r"checkpoint-(\d+)\.pt")


def save_checkpoint(path: str | Path, payload: dict[str, Any], keep: int = 1) -> None:
    """Write payload (plus format marker) to `path` atomically: temp file, fsync, rename.

    With keep > 1, `path` is also linked as `checkpoint-STEP.pt` beside it (payload["step"])
    and only the newest `keep` of those are kept.
    """
    path = Path(path)
    with atomic_write(path) as f:  # (straight into the file: no second copy in memory)
        torch.save({"format": FORMAT, "version": VERSION, **payload}, f)
    if keep > 1:
        kept = path.with_name(f"checkpoint-{int(payload['step']):07d}.pt")
        tmp = kept.with_name(f".{kept.name}.link.tmp")
        tmp.unlink(missing_ok=True)
        os.link(path, tmp)
        os.replace(tmp, kept)
        for old in kept_checkpoints(path.parent)[:-keep]:
            old.unlink()


def kept_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run folder's `checkpoint-STEP.pt` files, oldest first."""
    found = [(int(m.group(1)), p) for p in Path(run_dir).glob("checkpoint-*.pt") if (m := _KEPT.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def load_checkpoint(path: str | Path, *, trust: bool = False) -> dict[str, Any]:
    """Read a checkpoint; raises FileNotFoundError or ValueError with what is wrong: "is not
    an edgc checkpoint" (another file, or another torch file), "is corrupt or truncated" or
    "fails its checksum" (a damaged one), or "is refused" (edgc.safeload.UnsafeFileError: it
    names a Python object that loading would call). trust=True loads such a file, running
    that code: only for a checkpoint one trusts (edgc train --trust-checkpoint)."""
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {str(path)!r}; a run folder holds {CHECKPOINT_NAME} once "
                                f"it has reached its first checkpoint step")
    not_ours = f"{str(path)!r} is not an edgc checkpoint"
    if not is_torch_archive(path):  # (a text file, random bytes: not a damaged checkpoint)
        raise ValueError(not_ours)
    try:
        verify_checksums(path)
    except ValueError as exc:
        older = [p.name for p in kept_checkpoints(path.parent) if not os.path.samefile(p, path)]
        hint = (f"; older checkpoints kept beside it: {', '.join(older)} (resume from one with "
                f"--resume {path.parent / older[-1]})") if older else "; it cannot be resumed"
        raise ValueError(f"{exc}{hint}") from None
    try:
        data = load_torch(path, what="checkpoint", trust=trust,
                          how="edgc train --trust-checkpoint (in Python: load_checkpoint(..., trust=True))")
    except UnsafeFileError:
        raise
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError, OSError) as exc:
        raise ValueError(f"checkpoint {str(path)!r} is corrupt or truncated ({type(exc).__name__}: {exc}); "
                         f"it cannot be resumed") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(not_ours)
    if data.get("version") != VERSION:
        raise ValueError(f"checkpoint {str(path)!r} has version {data.get('version')}, this edgc reads {VERSION}")
    return data


def saved_tp(ckpt: dict[str, Any]) -> int:
    """The TP ranks of the job that wrote a checkpoint without a pipeline: the third entry
    of its HSDP layout, 1 without tensor parallelism."""
    return int(ckpt["hsdp"][2]) if len(ckpt.get("hsdp") or ()) > 2 else 1


def check_compatible(ckpt: dict[str, Any], *, world_size: int, preset: str, method: str, model_config: dict,
                     layout: tuple[int, ...] | None = None, hsdp: tuple[int, ...] | None = None) -> None:
    """Raise ValueError if a checkpoint cannot continue in this job, saying which setting differs.
    A run fits a job of another number of replicas with the same pipeline stages, HSDP
    shards and TP ranks (edgc.train.common.restore_resized, restore_resized_stage).

    `layout` is (pp, dp); None means no pipeline, (1, world_size). `hsdp` is (replicate,
    shard) of an HSDP job, (replicate, shard, tp) with tensor parallelism, None for DDP.
    """
    saved = ckpt["train"]
    problems = []
    saved_layout = tuple(ckpt.get("layout", (1, ckpt["world_size"])))
    job_layout = tuple(layout) if layout is not None else (1, world_size)
    saved_hsdp = tuple(int(x) for x in ckpt["hsdp"]) if ckpt.get("hsdp") is not None else None
    job_hsdp = tuple(hsdp) if hsdp is not None else None
    # a run goes on with another number of replicas, its stages, shards and TP ranks the
    # same (edgc.train.common.restore_resized, restore_resized_stage)
    same_shards = saved_hsdp is None and job_hsdp is None or (
        saved_hsdp is not None and job_hsdp is not None and (*saved_hsdp, 1)[1:3] == (*job_hsdp, 1)[1:3])
    resizable = same_shards and len(saved_layout) == len(job_layout) and saved_layout[0] == job_layout[0] \
        and saved_layout[2:] == job_layout[2:]
    if ckpt["world_size"] != world_size and resizable and method == "torch-powersgd":
        problems.append(f"world size: checkpoint {ckpt['world_size']}, this job {world_size} (a run of "
                        "torch-powersgd resumes only on the replicas it was saved on: torch keeps its error "
                        "feedback per DDP bucket)")
    if ckpt["world_size"] != world_size and resizable and method in ("diloco", "edgc-diloco"):
        problems.append(f"world size: checkpoint {ckpt['world_size']}, this job {world_size} (a DiLoCo run resumes "
                        "only on the replicas it was saved on: each holds its own weights between outer steps)")
    if ckpt["world_size"] != world_size and not resizable:
        problems.append(f"world size: checkpoint {ckpt['world_size']}, this job {world_size} (a run resumes on "
                        "another number of replicas only, with the same pipeline stages, shards and TP ranks)")
    if saved_layout != job_layout and not resizable:
        def say_layout(x: tuple[int, ...]) -> str:
            return f"pp={x[0]} x dp={x[1]}" + (f" x tp={x[2]}" if len(x) > 2 else "")
        problems.append(f"layout: checkpoint {say_layout(saved_layout)}, this job {say_layout(job_layout)}")
    if saved_hsdp != job_hsdp and not resizable:
        def say(x: tuple[int, ...] | None) -> str:
            tp = f" x {x[2]} TP ranks" if x is not None and len(x) > 2 else ""
            return f"HSDP {x[0]} replicas x {x[1]} shards{tp}" if x else "DDP"
        problems.append(f"data parallelism: checkpoint {say(saved_hsdp)}, this job {say(job_hsdp)}")
    if ckpt["world_size"] != world_size and resizable and int(saved.get("ep", 1)) > 1:
        problems.append(f"world size: checkpoint {ckpt['world_size']}, this job {world_size} (a run with experts "
                        "split over EP ranks resumes only on the layout it was saved on)")
    if saved["preset"] != preset or _with_defaults(ckpt["model_config"]) != _with_defaults(model_config):
        problems.append(f"model: checkpoint {saved['preset']} {ckpt['model_config']}, this job {preset} {model_config}")
    if saved["method"] != method:
        problems.append(f"method: checkpoint {saved['method']!r}, this job {method!r}")
    if problems:
        raise ValueError("checkpoint does not match this run: " + "; ".join(problems))


def _with_defaults(model_config: dict[str, Any]) -> dict[str, Any]:
    """A saved GPTConfig dict with the fields it predates at their defaults (a checkpoint of
    an older edgc lacks n_expert and the other expert fields, and is the same dense model)."""
    defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig) if f.default is not dataclasses.MISSING}
    return {**defaults, **model_config}
