"""How `edgc train` makes a plain GPT data-parallel: DDP with a communication hook, or
FSDP2 / HSDP (--dp-shard, --dp-replicate) with edgc.fsdp, behind one small interface the
training loop uses (`DataParallel`).

HSDP on R x S workers: a 2-D DeviceMesh ("replicate", "shard"), each GPT block and then
the whole model sharded with fully_shard. Method "none" shards on the whole mesh: native
HSDP, whose own all-reduce crosses the replicas (its bytes counted by
edgc.fsdp.count_native_hsdp). "powersgd" and "edgc" shard on the 1-D shard mesh and
register edgc.fsdp.register_edgc, which compresses that all-reduce. Checkpoints hold the
full (unsharded) model and optimiser state, as DDP runs' do, gathered to rank 0 with
torch.distributed.checkpoint.state_dict, and loaded back into the shards on resume.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from edgc.comm import EDGCState, edgc_hook
from edgc.comm.baselines import (
    AllReduceState,
    NoSyncState,
    TorchPowerSGDState,
    allreduce_hook,
    no_sync_hook,
    torch_powersgd_hook,
)
from edgc.config import EDGCConfig
from edgc.train.common import load_plain_weights
from edgc.train.config import TrainConfig

__all__ = ["DataParallel", "data_parallel"]


@dataclass
class DataParallel:
    """A model made data-parallel, as the training loop uses it."""

    module: nn.Module  # what the loop calls: the DDP wrapper, or the sharded model itself
    state: Any  # the gradient sync's state: stats(), state_dict(), load_state_dict()
    hsdp: tuple[int, int] | None  # (replicate, shard) under HSDP, else None
    sync: Callable[[bool], contextlib.AbstractContextManager]  # sync(last micro-batch?) around a backward
    weights: Callable[[nn.Module, torch.optim.Optimizer], tuple[dict, dict]]  # full (model, optimiser) states
    load_weights: Callable[[nn.Module, torch.optim.Optimizer, dict[str, Any]], None]  # from a checkpoint


def data_parallel(cfg: TrainConfig, model: nn.Module, device: torch.device, world: int) -> DataParallel:
    """`model` (on `device`) made data-parallel over `world` workers as `cfg` says."""
    if cfg.hsdp:
        return _hsdp(cfg, model, device, world)
    ddp = DDP(model, bucket_cap_mb=cfg.bucket_cap_mb, device_ids=[device.index] if device.type == "cuda" else None)

    def sync(last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if last else ddp.no_sync()

    return DataParallel(ddp, _attach_hook(cfg, ddp), None, sync, lambda m, o: (m.state_dict(), o.state_dict()),
                        load_plain_weights)


def _attach_hook(cfg: TrainConfig, ddp: DDP) -> Any:
    """Register the method's communication hook; returns its state (all have stats())."""
    if cfg.method == "none":
        state: Any = AllReduceState(None)
        ddp.register_comm_hook(state, allreduce_hook)
    elif cfg.method == "compute-only":
        state = NoSyncState(None)
        ddp.register_comm_hook(state, no_sync_hook)
    elif cfg.method == "torch-powersgd":
        edgc_cfg = EDGCConfig(**cfg.edgc)
        state = TorchPowerSGDState(None, rank=cfg.rank, start_iter=edgc_cfg.warmup_steps + 1,
                                   min_compression_rate=edgc_cfg.min_compression_rate, module=ddp.module)
        ddp.register_comm_hook(state, torch_powersgd_hook)
    else:  # powersgd (static policy) or edgc
        state = EDGCState(None, EDGCConfig(**cfg.edgc))
        ddp.register_comm_hook(state, edgc_hook)
    return state


def _hsdp(cfg: TrainConfig, model: nn.Module, device: torch.device, world: int) -> DataParallel:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from edgc.fsdp import count_native_hsdp, register_edgc

    layout = cfg.hsdp_layout(world)
    mesh = init_device_mesh(device.type, layout, mesh_dim_names=("replicate", "shard"))
    target = mesh if cfg.method == "none" else mesh["shard"]  # (none: native HSDP on the whole mesh)
    for block in model.h:  # type: ignore[union-attr]
        fully_shard(block, mesh=target)
    fully_shard(model, mesh=target)
    state = count_native_hsdp(model, mesh) if cfg.method == "none" else register_edgc(model, mesh,
                                                                                       EDGCConfig(**cfg.edgc))

    @contextlib.contextmanager
    def sync(last: bool) -> Iterator[None]:
        # (not the last micro-batch: reduce-scatter, and keep the sum for the last one,
        # natively or in edgc.fsdp's local sum)
        model.set_requires_all_reduce(last)  # type: ignore[operator]
        yield

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def weights(module: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
        # (collectives: every rank gathers; rank 0 gets the full states, the others empty dicts)
        return get_model_state_dict(module, options=full), get_optimizer_state_dict(module, opt, options=full)

    def load(module: nn.Module, opt: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
        every_rank = StateDictOptions(full_state_dict=True)  # (each rank read the checkpoint itself)
        set_model_state_dict(module, saved["model"], options=every_rank)
        set_optimizer_state_dict(module, opt, saved["optimizer"], options=every_rank)

    return DataParallel(model, state, layout, sync, weights, load)
