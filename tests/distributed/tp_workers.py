"""Worker functions for the tensor-parallel tests: a user's training script with torch's own
tensor parallelism (parallelize_module with ColwiseParallel / RowwiseParallel on mesh["tp"]),
fully_shard on mesh["shard"] and edgc.fsdp.register_edgc on mesh["replicate", "shard"]
(importable by spawned processes)."""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from edgc import EDGCConfig
from edgc.fsdp import register_edgc

VOCAB = 29
WIDTH = 24
HIDDEN = 40  # split 20 + 20 over 2 TP ranks


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding, position embedding and head outside the TP plan (whole on every TP rank);
    each block's MLP split column- then row-wise."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(10, WIDTH) * 0.1)  # (a 2-D tensor outside the plan)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}


def batch(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica `replica`'s batch of step `step`: the same on every TP rank of the replica."""
    g = torch.Generator().manual_seed(100_000 * step + replica)
    idx = torch.randint(0, VOCAB, (4, 10), generator=g)
    return idx, torch.roll(idx, shifts=1, dims=1)


def build(mode: str, layout: tuple[int, int, int], config: dict | None) -> tuple[nn.Module, Any, Any]:
    """The model split over mesh["tp"], then sharded as `mode` says: "native" on the
    (replicate, shard) mesh (native HSDP x TP), "edgc" on the shard mesh with
    register_edgc(mesh["replicate", "shard"], config); returns (model, state, mesh)."""
    torch.manual_seed(0)
    model = TinyLM()
    mesh = init_device_mesh("cpu", layout, mesh_dim_names=("replicate", "shard", "tp"))
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], PLAN)
    dp = mesh["replicate", "shard"]
    target = dp if mode == "native" else mesh["shard"]
    for block in model.blocks:
        fully_shard(block, mesh=target)
    fully_shard(model, mesh=target)
    state = register_edgc(model, dp, EDGCConfig.from_dict(config)) if mode == "edgc" else None
    return model, state, mesh


def _local(p: torch.Tensor) -> torch.Tensor:
    return (p.to_local() if isinstance(p, DTensor) else p).detach().clone()


def train(rank: int, world: int, mode: str, config: dict | None, steps: int,
          options: dict | None = None) -> dict[str, Any]:
    """Train `steps` steps on a (replicate, shard, tp) = `options["layout"]` mesh (default
    2 x 1 x 2); `options`: "stop_at" a step to save a checkpoint at, "resume" one such
    checkpoint per rank. Returns the full parameters (gathered over shards and TP), the
    TP-local ones, the losses, ranks, stats and the EDGC state."""
    options = options or {}
    layout = tuple(options.get("layout", (2, 1, 2)))
    model, state, mesh = build(mode, layout, config)  # type: ignore[arg-type]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start, saved = 0, None
    if options.get("resume") is not None:
        ckpt = torch.load(io.BytesIO(options["resume"][rank]), weights_only=False)
        for name, p in model.named_parameters():
            with torch.no_grad():
                p.to_local().copy_(ckpt["local"][name])
        opt.load_state_dict(ckpt["opt"])
        if state is not None:
            state.load_state_dict(ckpt["edgc"])
        start = ckpt["step"]
    replica = mesh["replicate"].get_local_rank() * layout[1] + mesh["shard"].get_local_rank()
    losses, ranks = [], []
    for step in range(start, steps):
        idx, target = batch(step, replica)
        loss = F.cross_entropy(model(idx).flatten(0, 1), target.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if state is not None:
            ranks.append(state.stats().step_rank)
        if step + 1 == options.get("stop_at"):
            buf = io.BytesIO()
            torch.save({"step": step + 1, "local": {n: _local(p) for n, p in model.named_parameters()},
                        "opt": opt.state_dict(), "edgc": state.state_dict() if state is not None else None}, buf)
            saved = buf.getvalue()
    out: dict[str, Any] = {
        "params": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
        "local": {n: _local(p) for n, p in model.named_parameters()},
        "losses": losses, "ranks": ranks, "saved": saved,
        "coords": (mesh["replicate"].get_local_rank(), mesh["shard"].get_local_rank(), mesh["tp"].get_local_rank()),
    }
    if state is not None:
        out["stats"] = state.stats()
        out["state"] = state.sync.state_dict()
        out["layout"] = state.state_dict()["layout"]
        out["uncounted"] = sorted(state.sync.compression.uncounted)
    dist.barrier()
    return out


def refusal(rank: int, world: int, case: str) -> str:
    """The message a TP layout edgc cannot serve raises; '' if none."""
    try:
        if case == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            from edgc import EDGCState, edgc_hook

            torch.manual_seed(0)
            model = TinyLM()
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            for block in model.blocks:
                parallelize_module(block, mesh["tp"], PLAN)
            ddp = DDP(model, device_mesh=mesh["dp"])
            ddp.register_comm_hook(EDGCState(mesh["dp"].get_group(), EDGCConfig(max_rank=4)), edgc_hook)
            idx, target = batch(0, mesh["dp"].get_local_rank())
            F.cross_entropy(ddp(idx).flatten(0, 1), target.reshape(-1)).backward()
        elif case == "other layout":
            _, state, _ = build("edgc", (2, 1, 2), dict(max_rank=4))
            saved = state.state_dict()
            saved["layout"] = [4, 1, 1]
            state.load_state_dict(saved)
        return ""
    except Exception as exc:  # (the message is what the test reads)
        return str(exc)
    finally:
        dist.barrier()
