"""Worker functions for the mixture-of-experts tests: a user's training script of the shape
edgc.moe documents (experts split with parallelize_experts, sharded on their own mesh,
register_edgc with expert_mesh), importable by spawned processes."""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from edgc import EDGCConfig
from edgc.fsdp import register_edgc
from edgc.models.gpt2 import build_model
from edgc.moe import expert_mesh, expert_parameter_names, parallelize_experts

PRESET = "tiny-moe"


def batch(step: int, rank: int, vocab: int = 2048) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, (2, 16), generator=g)


def _model(layout: tuple[int, int], ep: int, config: dict[str, Any], idle: bool = False,
           expert_config: dict[str, Any] | None = None):
    torch.manual_seed(0)
    model = build_model(PRESET, block_size=32)
    if idle:  # expert 0 of every block never chosen: its router logit pushed far down
        away = torch.zeros(8)
        away[0] = -1e4
        for block in model.h:
            block.mlp.router.register_forward_hook(lambda module, args, out: out + away)
    dense = init_device_mesh("cpu", layout, mesh_dim_names=("replicate", "shard"))
    sparse = expert_mesh(dense, ep)
    dispatch = parallelize_experts(model, sparse["ep"]) if ep > 1 else None
    for block in model.h:
        fully_shard(block.mlp.experts, mesh=sparse["shard"])
        fully_shard(block, mesh=dense["shard"])
    fully_shard(model, mesh=dense["shard"])
    state = register_edgc(model, dense, EDGCConfig(**config), expert_mesh=sparse,
                          expert_config=None if expert_config is None else EDGCConfig(**expert_config))
    return model, state, sparse, dispatch


def train(rank: int, world: int, layout: tuple[int, int], ep: int, config: dict[str, Any], steps: int,
          idle: bool = False, resume: bytes | None = None, first: int = 0,
          expert_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train `steps` steps (from step `first`, after loading `resume`: a state_dict as
    bytes); returns what the tests compare: each parameter made whole over its shards
    (experts: this EP rank's), the losses, both groups' ranks and stats, the reference
    gradients of the first step, and the states. `expert_config`: the experts' own
    EDGCConfig fields (register_edgc's expert_config)."""
    model, state, sparse, dispatch = _model(layout, ep, config, idle, expert_config)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if resume is not None:
        saved = torch.load(io.BytesIO(resume), weights_only=False)
        model.load_state_dict(saved["model"][rank])
        state.load_state_dict(saved["state"][rank])
    losses, ranks, expert_ranks, first_grads = [], [], [], None
    for step in range(first, first + steps):
        _, loss = model(batch(step, rank), batch(step, rank))
        loss.backward()
        if first_grads is None:
            first_grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        ranks.append(state.stats().step_rank)
        expert_ranks.append(state.expert_stats().step_rank)
    params = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
    blob = io.BytesIO()
    torch.save(model.state_dict(), blob)
    return {"params": params, "losses": losses, "ranks": ranks, "expert_ranks": expert_ranks,
            "stats": state.stats(), "expert_stats": state.expert_stats(), "first_grads": first_grads,
            "state": state.state_dict(), "model": blob.getvalue(), "ep_rank": sparse["ep"].get_local_rank(),
            "expert_replica": sparse["replicate"].get_local_rank(), "names": expert_parameter_names(model),
            "a2a": dispatch.bytes_sent if dispatch is not None else 0}


def reference(world: int, steps: int) -> dict[str, torch.Tensor]:
    """One process: the first step's gradients averaged over `world` workers' batches."""
    torch.manual_seed(0)
    model = build_model(PRESET, block_size=32)
    for rank in range(world):
        _, loss = model(batch(0, rank), batch(0, rank))
        (loss / world).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def refuse_expert_config_alone(rank: int, world: int) -> str:
    """register_edgc given the experts' settings but no expert mesh: the error it raises."""
    torch.manual_seed(0)
    model = build_model(PRESET, block_size=32)
    dense = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    for block in model.h:
        fully_shard(block, mesh=dense["shard"])
    fully_shard(model, mesh=dense["shard"])
    try:
        register_edgc(model, dense, EDGCConfig(max_rank=4), expert_config=EDGCConfig(max_rank=2))
    except ValueError as exc:
        return str(exc)
    return "no error"


def refuse_ddp(rank: int, world: int) -> str:
    """edgc's DDP hook on a model whose experts are split: the error it raises."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from edgc.comm import EDGCState, edgc_hook

    torch.manual_seed(0)
    model = build_model(PRESET, block_size=32)
    parallelize_experts(model, dist.group.WORLD)
    ddp = DDP(model)
    ddp.register_comm_hook(EDGCState(None, EDGCConfig(max_rank=4)), edgc_hook)
    try:
        _, loss = ddp(batch(0, rank), batch(0, rank))
        loss.backward()
    except Exception as exc:  # (the test checks which)
        return f"{type(exc).__name__}: {exc}"
    return "no error"
