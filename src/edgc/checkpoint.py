"""Checkpoint every replica's EDGC state, with any training loop or framework.

Error feedback is each replica's own (it holds what that replica's gradient lost to
compression), so a checkpoint must hold every replica's state and give each replica
its own back; EDGCState.load_state_dict refuses another replica's. Frameworks save what
rank 0 holds, so the states are gathered there first:

    states = gather_states(state)          # every replica calls; a list on rank 0, None elsewhere
    ...put `states` into the framework's checkpoint (rank 0 writes it)...
    restore_state(state, states)           # on resume, every replica, before the first step

or, as a file beside the framework's own checkpoint folder:

    save_states(state, folder)             # every replica calls; rank 0 writes folder/edgc_state.pt
    load_states(state, folder)             # every replica reads its own entry

A job of another world size gets a ValueError that says both sizes, unless it asks for
the states to be resized (`resize=True`, `resize_states`): Q, the policy's state and
every other agreed value carry over, and each new replica's error feedback is the old
replicas' mean, which keeps the correction still to be sent (its average over the
replicas). The functions work with any hook state that has state_dict() and
load_state_dict() (the baselines in edgc.comm.baselines too; resizing needs EDGCState's
states); the collectives are in edgc.comm.replicas.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from edgc.atomic import atomic_write
from edgc.comm.replicas import gather_replicas, replica_entry, scatter_replicas, world_and_rank
from edgc.comm.state_format import check_state
from edgc.safeload import UnsafeFileError, load_torch

__all__ = ["FILE_NAME", "gather_states", "is_torch_archive", "load_states", "read_states", "resize_states",
           "resized_state", "restore_state", "save_states", "verify_checksums"]

FILE_NAME = "edgc_state.pt"
_FORMAT = "edgc-replica-states"
_VERSION = 1


def _group(state: Any) -> Any:
    return getattr(state, "process_group", None)


def gather_states(state: Any, *, dst: int | None = 0) -> list[dict[str, Any]] | None:
    """Every replica's `state.state_dict()`, in rank order within the state's process
    group: on the replica of group rank `dst` (None on the others), or on every replica
    with dst=None. A collective that every replica must call; changes nothing."""
    return gather_replicas(state.state_dict(), dst=dst, group=_group(state))


def restore_state(state: Any, states: list[dict[str, Any]] | None, *, src: int | None = None,
                  resize: bool = False) -> None:
    """Load this replica's own entry of `states` (as gather_states returned them) into
    `state`; call it before the first training step.

    src=None: every replica holds the whole list (each read the checkpoint). src=r: only
    replica r holds it, the others pass None, and it is scattered (a collective).
    Raises ValueError when the list is from a job of another world size, unless `resize`:
    then the states are first made this job's number (resize_states).
    """
    world, rank = world_and_rank(_group(state))
    if resize and src is None and states is not None:
        state.load_state_dict(resized_state(states, world, rank))
        return
    if resize and states is not None:
        states = resize_states(states, world)
    if src is None:
        mine = replica_entry(states, group=_group(state), what="the EDGC checkpoint")
    else:
        mine = scatter_replicas(states, src=src, group=_group(state))
    state.load_state_dict(mine)


def save_states(state: Any, folder: str | Path, *, step: int | None = None) -> Path | None:
    """Gather every replica's state and write them to `folder`/edgc_state.pt, atomically
    (temporary file, then rename), from group rank 0. A collective that every replica
    must call. `step` is recorded for load_states to check. Returns the file's path on
    the writing replica, None on the others."""
    states = gather_states(state, dst=0)
    if states is None:
        return None
    path = Path(folder) / FILE_NAME
    buf = io.BytesIO()
    torch.save({"format": _FORMAT, "version": _VERSION, "world_size": len(states), "step": step,
                "replicas": states}, buf)
    with atomic_write(path) as f:
        f.write(buf.getbuffer())
    return path


def read_states(folder: str | Path, *, mmap: bool = False, trust: bool = False) -> dict[str, Any]:
    """The contents of `folder`/edgc_state.pt (or of the file `folder`): {"world_size",
    "step", "replicas"}; raises FileNotFoundError or ValueError saying what is wrong.

    Only tensors and plain values are loaded: a file that names other Python objects (code
    that loading would run) raises edgc.safeload.UnsafeFileError, a ValueError naming the
    file and the object. trust=True loads it anyway, running that code: only for a file
    one trusts.

    mmap=True maps the tensors from the file instead of reading them, so that a replica
    that reads every replica's states holds only the pages of the entry it uses. Copy
    what you keep: a mapped file rewritten in place (not replaced, as save_states does)
    kills the reading process with SIGBUS.
    """
    path = Path(folder)
    if path.is_dir():
        path = path / FILE_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no EDGC state at {str(path)!r}: it is written beside a checkpoint by "
                                f"edgc.checkpoint.save_states (or an edgc integration) when the checkpoint is saved")
    not_ours = f"{str(path)!r} is not an EDGC state file (written by edgc.checkpoint.save_states)"
    if not is_torch_archive(path):
        raise ValueError(not_ours)
    verify_checksums(path)
    try:
        data = load_torch(path, what="EDGC state", how="read_states(..., trust=True) or load_states(..., trust=True)",
                          trust=trust, mmap=mmap)
    except UnsafeFileError:
        raise
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError, OSError) as exc:
        raise ValueError(f"EDGC state {str(path)!r} is corrupt or truncated ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise ValueError(not_ours)
    if data.get("version") != _VERSION:
        raise ValueError(f"EDGC state {str(path)!r} has version {data.get('version')}, this edgc reads {_VERSION}")
    return data


def load_states(state: Any, folder: str | Path, *, step: int | None = None, trust: bool = False,
                resize: bool = False) -> None:
    """Load this replica's own state from `folder`/edgc_state.pt (save_states' file) into
    `state`; every replica reads the file. With `step`, the file must have been saved at
    that step (a check that the folder belongs to the checkpoint being resumed).
    Raises ValueError on a corrupt file, another world size (unless `resize`: the states
    are made this job's number first, resize_states) or another step, and on a file that
    names code to run, unless `trust` (read_states)."""
    data = read_states(folder, mmap=True, trust=trust)  # (copied below: only this replica's entry is read)
    if step is not None and data.get("step") is not None and int(data["step"]) != step:
        raise ValueError(f"the EDGC state in {str(folder)!r} was saved at step {data['step']}, and training "
                         f"resumes at step {step}")
    world, rank = world_and_rank(_group(state))
    if resize and isinstance(data["replicas"], list) and len(data["replicas"]) != world:
        state.load_state_dict(resized_state(data["replicas"], world, rank))
        return
    mine = replica_entry(data["replicas"], group=_group(state), what=f"the EDGC state file in {str(folder)!r}")
    state.load_state_dict(_own_copy(mine))


def resize_states(states: list[dict[str, Any]], world: int) -> list[dict[str, Any]]:
    """EDGCState states of one job (gather_states' list, in replica order) made into
    `world` states, for a job that resumes on another number of replicas.

    Everything the replicas agree on is taken from the first: Q, the policy's state, the
    entropy windows, the window's gradient sums, the warm-up gate, the phase and the rank,
    so compression goes on where it was, with no second warm-up. The error feedback is
    each replica's own; every new replica gets the old replicas' mean (summed in float64,
    stored in the dtype it was saved in), which keeps the average over the replicas: the
    correction still to be sent. The counters in "stats" are the first replica's. The same
    list is returned, unchanged, when it already has `world` states. Raises ValueError for
    an empty list, a state that is not EDGCState's (version 1 states are upgraded), states
    of different steps or layouts, or a world below 1. Changes nothing in `states`.
    """
    if world < 1:
        raise ValueError(f"world must be at least 1, got {world}")
    if isinstance(states, list) and len(states) == world:
        return states
    template = _resized_template(states)
    return [_entry(template, world, replica) for replica in range(world)]


def resized_state(states: list[dict[str, Any]], world: int, replica: int) -> dict[str, Any]:
    """resize_states(states, world)[replica], without building the other entries: what
    one replica of the new job loads."""
    if isinstance(states, list) and len(states) == world:
        return states[replica]
    return _entry(_resized_template(states), world, replica)


def _entry(template: dict[str, Any], world: int, replica: int) -> dict[str, Any]:
    """Replica `replica` of `world`'s state, a copy of `template` (each replica its own
    tensors: a state loaded is a state its replica goes on to change)."""
    return {**_own_copy(template), "world_size": world, "replica": replica}


def _resized_template(states: list[dict[str, Any]]) -> dict[str, Any]:
    """The state every resized replica starts from (resize_states), its tensors shared with
    `states` but for the error feedback's means."""
    if not isinstance(states, list) or not states:
        raise ValueError("resize_states needs the non-empty list of every replica's state that gather_states gives")
    checked = [check_state(s) for s in states]
    first = checked[0]
    for i, s in enumerate(checked[1:], start=1):
        if (s["step"], s["phase"]) != (first["step"], first["phase"]):
            raise ValueError(f"replica {i}'s EDGC state is at step {s['step']} ({s['phase']}), replica 0's at "
                             f"step {first['step']} ({first['phase']}): they are not one checkpoint")
        if len(s["compression"]["groups"]) != len(first["compression"]["groups"]):
            raise ValueError(f"replica {i}'s EDGC state has {len(s['compression']['groups'])} groups, replica 0's "
                             f"{len(first['compression']['groups'])}: they are not one job's")
    means: list[torch.Tensor | None] = []
    for g, group in enumerate(first["compression"]["groups"]):
        errors = [s["compression"]["groups"][g]["error"] for s in checked]
        if group["error"] is None or any(e is None for e in errors):
            means.append(None)
            continue
        if any(e.shape != group["error"].shape for e in errors):
            raise ValueError(f"the replicas' error feedback of group {g} differs in shape: not one job's states")
        total = torch.zeros(group["error"].shape, dtype=torch.float64)
        for e in errors:
            total += e.to(torch.float64)
        means.append((total / len(errors)).to(group["error"].dtype))
    groups = [{**group, "error": mean} for group, mean in zip(first["compression"]["groups"], means, strict=True)]
    return {**first, "compression": {**first["compression"], "groups": groups}}


def _own_copy(obj: Any) -> Any:
    """`obj` with its tensors copied into memory (out of the memory-mapped file, which a
    later save may replace)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _own_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_own_copy(v) for v in obj)
    return obj


# the first bytes of every zip archive's first record, so of every torch.save file
_ZIP_MAGIC = b"PK\x03\x04"


def is_torch_archive(path: str | Path) -> bool:
    """Whether the file at `path` begins as a torch.save archive does, damaged or whole: a
    checkpoint cut short or with a flipped byte does (verify_checksums then says what is
    wrong), a text file, random bytes or an empty file do not. Reads 4 bytes; True for a
    file that cannot be read, for verify_checksums to report."""
    try:
        with open(path, "rb") as f:
            return f.read(len(_ZIP_MAGIC)) == _ZIP_MAGIC
    except OSError:
        return True


def verify_checksums(path: str | Path) -> None:
    """Raise ValueError if a record of torch.save's zip archive at `path` fails its CRC-32
    (a flipped byte in tensor data is an error here, not a NaN loss some steps later)."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise ValueError(f"checkpoint {str(path)!r} is corrupt or truncated ({type(exc).__name__}: {exc})") from None
    if bad is not None:
        raise ValueError(f"checkpoint {str(path)!r} is corrupt: its record {bad!r} fails its checksum (CRC-32)")
