"""What `edgc train` records of a model with experts (edgc.models.moe): each group's bytes,
the tokens' all-to-all and the experts' load."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from edgc.comm.replicas import tensors_digest
from edgc.moe import busiest_share, expert_parameter_names, load_counts

__all__ = ["expert_digests", "expert_record", "expert_stats"]


def expert_stats(hook_state: Any) -> Any:
    """The experts' counters of a state that has them (edgc.fsdp with experts), else None."""
    get = getattr(hook_state, "expert_stats", None)
    return get() if get is not None else None


def expert_record(model: torch.nn.Module, hook_state: Any, prev: Any, dispatch: Any, world: int,
                  device: torch.device) -> tuple[dict[str, Any], Any]:
    """A step's figures of a model with experts, for its metrics record: with an experts'
    core of their own (FSDP, edgc.moe), "expert_bytes" (this worker's sends averaging the
    experts' gradients; "expert_bytes_uncompressed" for the record's totals) and
    "expert_rank" (the rank they were sent at, 0 uncompressed); always
    "a2a_bytes" (the tokens' all-to-alls, a worker's mean),
    "expert_tokens" (assignments each expert received, every worker and block together)
    and "busiest_expert_share"; and the experts' counters now (the next step's `prev`)."""
    stats = expert_stats(hook_state)
    sent = stats.bytes_sent - prev.bytes_sent if stats is not None else 0
    whole = stats.bytes_uncompressed - prev.bytes_uncompressed if stats is not None else 0
    load = load_counts(model)
    assert load is not None  # (a model with experts)
    a2a = dispatch.reset() if dispatch is not None else 0
    both = torch.cat([load.to(device), torch.tensor([a2a], dtype=torch.int64, device=device)])
    # collective (metrics only): all-reduce SUM of the experts' counts and the all-to-all bytes, (E + 1) int64
    dist.all_reduce(both)
    load = both[:-1].cpu()
    record: dict[str, Any] = {"a2a_bytes": int(both[-1]) // world, "expert_tokens": load.tolist(),
                              "busiest_expert_share": busiest_share(load)}
    if stats is not None:  # (under DDP the experts share the dense parameters' core: no split to report)
        record.update(expert_bytes=sent, expert_bytes_uncompressed=whole, expert_rank=stats.step_rank)
    return record, stats


def expert_digests(model: torch.nn.Module) -> dict[str, str]:
    """{"dense_digest", "expert_digest"}: digests of this worker's dense parameters and of
    its experts, as it holds them (its shards), to tell that replicas are bit-identical."""
    names = set(expert_parameter_names(model))

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    params = list(model.named_parameters())
    return {"dense_digest": tensors_digest(local(p) for n, p in params if n not in names),
            "expert_digest": tensors_digest(local(p) for n, p in params if n in names)}
