"""Per-replica payloads for checkpoints: gather every replica's to one, hand each back its own.

Why not keep one replica's state. EDGC's error-feedback buffers hold what each replica's
own gradient lost to compression, so they differ between replicas; a checkpoint that
saves rank 0's state and loads it everywhere gives every other replica the wrong
residual. So a checkpoint holds a list, one entry per replica in rank order, and each
replica takes back the entry at its own rank. These are the collectives for that, with
no file format and no framework in them (edgc.checkpoint and edgc.train build on them).
"""

from __future__ import annotations

import copy
import hashlib
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["blobs_as_tensors", "gather_replicas", "replica_entry", "scatter_replicas", "tensors_digest",
           "world_and_rank"]


def world_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(world size, this process's rank) in `group`; (1, 0) without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _global(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank of `group_rank` in `group` (collectives take global ranks)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def gather_replicas(mine: Any, *, dst: int | None = 0, group: dist.ProcessGroup | None = None) -> list[Any] | None:
    """Every replica's `mine` (any picklable object), in rank order within `group`.

    A collective: every replica of the group must call it. Returns the list on the
    replica whose group rank is `dst` and None on the others; with dst=None, every
    replica gets the list (each then holds world × payload in memory). Changes nothing.
    """
    world, rank = world_and_rank(group)
    if world == 1:
        return [mine]
    if dst is None:
        gathered: list[Any] = [None] * world
        # collective: all-gather of each replica's pickled payload (its size × world, to every replica)
        dist.all_gather_object(gathered, mine, group=group)
        return gathered
    if not 0 <= dst < world:
        raise ValueError(f"dst must be a rank of the group, 0 to {world - 1}; got {dst}")
    if rank != dst:
        # collective (with the loop below): this replica's pickled payload to replica `dst`
        dist.send_object_list([mine], dst=_global(group, dst), group=group)
        return None
    # One replica after the other, not gather_object: that holds every payload's bytes at
    # once besides the objects unpickled from them (twice the states on `dst`); here `dst`
    # holds the objects and one payload's bytes. Its own entry is a copy, as the others are.
    out: list[Any] = [None] * world
    for src in range(world):
        if src == dst:
            out[src] = copy.deepcopy(mine)
            continue
        box: list[Any] = [None]
        dist.recv_object_list(box, src=_global(group, src), group=group)
        out[src] = box[0]
    return out


def replica_entry(entries: Any, *, group: dist.ProcessGroup | None = None, what: str = "checkpoint") -> Any:
    """This replica's own entry of `entries` (every replica's, in rank order, as
    gather_replicas returns them). Raises ValueError when the list was written by a job
    of another world size, saying both sizes; `what` names the source in the message."""
    world, rank = world_and_rank(group)
    if not isinstance(entries, (list, tuple)):
        raise ValueError(f"{what} holds no per-replica list (got {type(entries).__name__}); it was not written by "
                         "gather_replicas or edgc.checkpoint")
    if len(entries) != world:
        raise ValueError(f"{what} holds the states of {len(entries)} replicas, and this job has {world}: error "
                         f"feedback is per replica, so a compressed run resumes only at the world size it was "
                         f"saved at ({len(entries)})")
    return entries[rank]


def scatter_replicas(entries: list[Any] | None, *, src: int = 0, group: dist.ProcessGroup | None = None) -> Any:
    """The reverse of gather_replicas(dst=src): replica `src` holds every replica's entry
    (the others pass None), and each replica gets its own back. For a checkpoint that
    only one replica can read. A collective; when the list's length is not the world
    size, every replica raises the ValueError of replica_entry (none is left waiting)."""
    world, rank = world_and_rank(group)
    if world == 1:
        return replica_entry(entries, group=group)
    count = [len(entries) if rank == src and isinstance(entries, (list, tuple)) else -1]
    # collective: broadcast of the list's length from `src` (a small pickled int), so that
    # a wrong list fails on every replica instead of leaving the others in the scatter
    dist.broadcast_object_list(count, src=_global(group, src), group=group)
    if count[0] != world:
        replica_entry([None] * count[0] if count[0] >= 0 else None, group=group, what=f"the list on replica {src}")
    out: list[Any] = [None]
    # (on `src`, entries is a list of `world` entries by now: any other value raised above)
    payload = list(entries) if rank == src and entries is not None else None
    # collective: scatter of one pickled payload from replica `src` to each replica
    dist.scatter_object_list(out, payload, src=_global(group, src), group=group)
    return out[0]


def blobs_as_tensors(obj: Any) -> Any:
    """`obj` with every bytes value in its dicts and lists as a uint8 tensor over the same
    memory (no copy), for torch.save: it pickles a bytes value into its in-memory pickle
    stream, copying it two or three times, but writes a tensor's storage straight to the
    file. (An FSDP state's compression state is such a value: edgc.fsdp.) An empty bytes
    value becomes an empty tensor: torch.load(weights_only=True), as edgc loads files,
    refuses an empty bytes (it is pickled as a call of `bytes`). Changes nothing."""
    if isinstance(obj, bytes) and not obj:
        return torch.empty(0, dtype=torch.uint8)  # (torch.frombuffer refuses an empty buffer)
    if isinstance(obj, bytes):
        with warnings.catch_warnings():  # (read-only memory: the tensor is only ever read)
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(obj, dtype=torch.uint8)
    if isinstance(obj, dict):
        return {k: blobs_as_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [blobs_as_tensors(v) for v in obj]
    return obj


def tensors_digest(tensors: Iterable[torch.Tensor]) -> str:
    """SHA-256 of the tensors' bytes, in order: equal on two replicas only if every tensor
    is bit-identical (how tests and soaks compare replicas without moving weights)."""
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()
