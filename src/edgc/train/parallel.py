"""How `edgc train` makes a plain GPT data-parallel: DDP with a communication hook, or
FSDP2 / HSDP (--dp-shard, --dp-replicate) with edgc.fsdp, behind one small interface the
training loop uses (`DataParallel`).

HSDP on R x S workers: a 2-D DeviceMesh ("replicate", "shard"), each GPT block and then
the whole model sharded with fully_shard. With tensor parallelism (--tp T) the mesh is
("replicate", "shard", "tp"), the blocks are split over mesh["tp"] first
(edgc.train.tensor_parallel), then sharded on mesh["shard"] as above, and edgc is
registered on mesh["replicate", "shard"]: each TP rank's shards are compressed over its
own replicate group. Method "none" shards on the whole mesh: native
HSDP, whose own all-reduce crosses the replicas (its bytes counted by
edgc.fsdp.count_native_hsdp). "powersgd" and "edgc" shard on the 1-D shard mesh and
register edgc.fsdp.register_edgc, which compresses that all-reduce. A model with experts run
(edgc.models.moe) this way (--ep > 1 always is): each block's experts are an FSDP unit of their own on
the expert mesh (edgc.moe.expert_mesh; with --ep > 1 split over the EP ranks first), and
register_edgc (or, for "none", count_native_hsdp) is given that mesh. Checkpoints hold the
full (unsharded) model and optimiser state, as DDP runs' do, gathered to rank 0 with
torch.distributed.checkpoint.state_dict (with --ep, gathered on every rank and the experts
made whole over the EP group), and loaded back into the shards on resume.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
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
from edgc.train.config import DILOCO_METHODS, TrainConfig

__all__ = ["DataParallel", "DiLoCoRun", "clip_grads", "data_parallel", "replica_bytes"]


@dataclass
class DataParallel:
    """A model made data-parallel, as the training loop uses it."""

    module: nn.Module  # what the loop calls: the DDP wrapper, or the sharded model itself
    state: Any  # the gradient sync's state: stats(), state_dict(), load_state_dict()
    hsdp: tuple[int, ...] | None  # (replicate, shard) under HSDP, (replicate, shard, tp) with TP, else None
    sync: Callable[[bool], contextlib.AbstractContextManager]  # sync(last micro-batch?) around a backward
    weights: Callable[[nn.Module, torch.optim.Optimizer], tuple[dict, dict]]  # full (model, optimiser) states
    load_weights: Callable[[nn.Module, torch.optim.Optimizer, dict[str, Any]], None]  # from a checkpoint
    tp_group: Any = None  # this worker's TP group (tp > 1), else None
    tp_rank: int = 0  # this worker's place in it
    dispatch: Any = None  # the experts' all-to-all (edgc.moe.ExpertParallel) with --ep > 1, else None
    experts: tuple[frozenset[int], Any] | None = None  # (ids of the expert parameters, the EP group or None)

    @property
    def tp(self) -> int:
        """Tensor-parallel ranks per replica (1 without TP)."""
        return self.hsdp[2] if self.hsdp is not None and len(self.hsdp) == 3 else 1


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
    elif cfg.method in ("compute-only", *DILOCO_METHODS):  # (DiLoCo syncs every H steps: DiLoCoRun)
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


class DiLoCoRun:
    """--method diloco and edgc-diloco: edgc.diloco.DiLoCo over the replica's plain model,
    as the training loop's sync state. The DDP wrapper syncs nothing (no_sync_hook); this
    syncs every H steps (`step()` after each optimiser step). Its state holds this
    replica's own model and optimiser besides DiLoCo's (θ, the outer momentum, the
    compression state): between outer steps the replicas' weights differ, and a resume in
    the middle of an inner phase needs each one's."""

    def __init__(self, cfg: TrainConfig, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        from edgc.diloco import DiLoCo

        self.model, self.opt = model, opt
        compression = cfg.edgc_config() if cfg.method == "edgc-diloco" else None
        self.diloco = DiLoCo(model, opt, None, inner_steps=cfg.resolved_inner_steps(), outer_lr=cfg.diloco_outer_lr,
                             outer_momentum=cfg.diloco_outer_momentum, compression=compression)

    def step(self) -> bool:
        return self.diloco.step()

    def stats(self) -> Any:
        return self.diloco.stats()

    def set_learning_rate(self, lr: float) -> None:
        if self.diloco.sync is not None:
            self.diloco.sync.set_learning_rate(lr)

    def state_dict(self) -> dict[str, Any]:
        return {"diloco": self.diloco.state_dict(), "model": self.model.state_dict(),
                "optimizer": self.opt.state_dict()}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if not isinstance(d, dict) or "diloco" not in d:
            raise ValueError("this checkpoint's sync state is not a DiLoCo run's: resume it with the method it ran")
        self.model.load_state_dict(d["model"])
        self.opt.load_state_dict(d["optimizer"])
        self.diloco.load_state_dict(d["diloco"])


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
    from edgc.moe import (
        expert_mesh,
        expert_parameter_names,
        moe_layers,
        parallelize_experts,
        to_expert_file_layout,
        to_expert_local_layout,
    )
    from edgc.train.tensor_parallel import apply_tp, to_file_layout, to_tp_layout

    layout = cfg.hsdp_layout(world)
    n_embd = int(model.config.n_embd)  # type: ignore[union-attr, arg-type]
    tp_group, tp_rank = None, 0
    if cfg.tp > 1:  # (TP innermost: a replica's TP ranks are adjacent workers)
        whole = init_device_mesh(device.type, layout, mesh_dim_names=("replicate", "shard", "tp"))
        apply_tp(model, whole["tp"], sequence_parallel=cfg.sequence_parallel, vocab_parallel=cfg.vocab_parallel)
        mesh = whole["replicate", "shard"]
        tp_group, tp_rank = whole["tp"].get_group(), whole["tp"].get_local_rank()
    else:
        mesh = init_device_mesh(device.type, layout, mesh_dim_names=("replicate", "shard"))
    native = cfg.method == "none"  # (native HSDP on the whole mesh)
    target = mesh if native else mesh["shard"]
    sparse, dispatch = None, None
    if any(True for _ in moe_layers(model)):  # (experts: their own FSDP units, on their own mesh: edgc.moe)
        sparse = expert_mesh(mesh, cfg.ep)
        if cfg.ep > 1:
            dispatch = parallelize_experts(model, sparse["ep"], wire=cfg.ep_wire)
    for block in model.h:  # type: ignore[union-attr]
        if sparse is not None:
            fully_shard(block.mlp.experts, mesh=sparse["replicate", "shard"] if native else sparse["shard"])
        fully_shard(block, mesh=target)
    fully_shard(model, mesh=target)
    state = count_native_hsdp(model, mesh, expert_mesh=sparse) if native else register_edgc(
        model, mesh, EDGCConfig(**cfg.edgc), expert_mesh=sparse,
        expert_config=EDGCConfig(**cfg.expert_edgc) if cfg.expert_edgc else None)
    names = expert_parameter_names(model) if dispatch is not None else []
    ep_group = sparse["ep"].get_group() if sparse is not None and cfg.ep > 1 else None

    @contextlib.contextmanager
    def sync(last: bool) -> Iterator[None]:
        # (not the last micro-batch: reduce-scatter, and keep the sum for the last one,
        # natively or in edgc.fsdp's local sum)
        model.set_requires_all_reduce(last)  # type: ignore[operator]
        yield

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def weights(module: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
        # (collectives: every rank gathers; rank 0 gets the full states, the others empty dicts;
        # with TP, c_attn's rows go back to GPT-2's order: edgc.train.tensor_parallel)
        if ep_group is not None:  # (experts: each EP rank's, made whole over the EP group, on every rank)
            every = StateDictOptions(full_state_dict=True)
            return to_expert_file_layout(_on_cpu(get_model_state_dict(module, options=every)),
                                         _on_cpu(get_optimizer_state_dict(module, opt, options=every)), names, ep_group)
        return to_file_layout(get_model_state_dict(module, options=full),
                              get_optimizer_state_dict(module, opt, options=full), cfg.tp, n_embd)

    def load(module: nn.Module, opt: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
        every_rank = StateDictOptions(full_state_dict=True)  # (each rank read the checkpoint itself)
        model_state, opt_state = to_tp_layout(saved["model"], saved["optimizer"], cfg.tp, n_embd)
        if ep_group is not None:  # (this EP rank's experts)
            model_state, opt_state = to_expert_local_layout(model_state, opt_state, names, ep_group)
        set_model_state_dict(module, model_state, options=every_rank)
        set_optimizer_state_dict(module, opt, opt_state, options=every_rank)

    held = (frozenset(id(p) for _, m in moe_layers(model) for p in m.experts.parameters()), ep_group)
    return DataParallel(model, state, layout, sync, weights, load, tp_group, tp_rank, dispatch,
                        held if sparse is not None else None)


def _on_cpu(d: Any) -> Any:
    """A state dict's tensors moved to the CPU (nested dicts and lists followed)."""
    if isinstance(d, torch.Tensor):
        return d.cpu()
    if isinstance(d, dict):
        return {k: _on_cpu(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_on_cpu(v) for v in d]
    return d


def clip_grads(model: torch.nn.Module, max_norm: float, *, tp: int = 1,
               experts: tuple[frozenset[int], Any] | None = None) -> torch.Tensor:
    """Scale the gradients so that their total norm is at most `max_norm`; returns the
    norm before (a plain tensor, the same on every worker). With tensor parallelism the
    parameters live on two meshes (shard, and shard x tp), which torch's clip_grad_norm_
    cannot stack: each mesh's norm is made whole (a collective per mesh) and summed
    here, counting a tensor held whole on every TP rank once. With experts (`experts`:
    their parameters' ids and the EP group, DataParallel.experts) the experts' part is
    summed over the EP ranks too, each holding its own experts."""
    if tp == 1 and experts is None:
        return _whole(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    ids, ep_group = experts if experts is not None else (frozenset(), None)
    by_mesh: dict[tuple[bool, Any], list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.grad is not None:
            by_mesh.setdefault((id(p) in ids, getattr(p.grad, "device_mesh", None)), []).append(p.grad)
    squares = []
    for (expert, _), grads in sorted(by_mesh.items(), key=lambda kv: (kv[0][0], tuple(
            kv[0][1].mesh_dim_names or ()) if kv[0][1] is not None else ())):
        square = _whole(torch.nn.utils.get_total_norm(grads)).square()
        if expert and ep_group is not None:
            # collective: all-reduce SUM of one float over the EP group (each rank's own experts)
            dist.all_reduce(square, group=ep_group)
        squares.append(square)
    norm = torch.stack(squares).sum().sqrt()
    coef = float(max_norm) / (float(norm) + 1e-6)
    if coef < 1.0:
        for grads in by_mesh.values():
            for g in grads:
                g.mul_(coef)
    return norm


def replica_bytes(run: DataParallel, sent: int, whole: int) -> tuple[int, int]:
    """A step's bytes for the metrics: this worker's, or with tensor parallelism its
    replica's, summed over the replica's TP ranks (each sends its own shards)."""
    if run.tp_group is None:
        return sent, whole
    both = torch.tensor([sent, whole], dtype=torch.int64)
    # collective (metrics only): all-reduce SUM of 2 int64 over the TP group, 16 bytes
    dist.all_reduce(both, group=run.tp_group)
    return int(both[0]), int(both[1])


def _whole(norm: torch.Tensor) -> torch.Tensor:
    """A gradient norm as a plain tensor (under FSDP torch returns a DTensor)."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
