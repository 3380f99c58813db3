"""Worker functions for the FSDP2 / HSDP tests: a user's training script, written as a user
would write it with fully_shard and edgc.fsdp.register_edgc (importable by spawned
processes)."""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from edgc import EDGCConfig
from edgc.fsdp import register_edgc

VOCAB = 33  # odd sizes: shards of 2 are uneven (17 + 16 rows, padded to 17)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 37)
        self.down = nn.Linear(37, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """`units`: how the ends are sharded (`build`): "apart" (the default), "joint" (a
    final norm and the head as one FSDP unit) or "tied" (the head's weight is the
    embedding's, the two one unit)."""

    def __init__(self, width: int = 24, vocab: int = VOCAB, units: str = "apart") -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([Block(width), Block(width)])
        self.norm = nn.LayerNorm(width) if units == "joint" else nn.Identity()
        self.head = nn.Linear(width, vocab, bias=False)
        if units == "tied":
            self.head.weight = self.emb.weight
        self.skip_head = False  # (a step in which a parameter gets no gradient)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return x if self.skip_head else self.head(self.norm(x))


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100_000 * step + 1000 * micro + rank)
    idx = torch.randint(0, VOCAB, (4, 10), generator=g)
    return idx, torch.roll(idx, shifts=1, dims=1)


def build(mode: str, layout: tuple[int, int], config: dict | None, dtype: str | None = None,
          mesh_names: tuple[str, str] = ("replicate", "shard"), vocab: int = VOCAB,
          units: str = "apart") -> tuple[nn.Module, Any, Any]:
    """The model sharded as `mode` says: "native" on the whole 2-D mesh (native HSDP),
    "edgc" on the shard mesh with register_edgc(config); returns (model, state, mesh).
    `units` (TinyLM): "joint" and "tied" shard two modules as one FSDP unit,
    fully_shard([norm, head]) or fully_shard([emb, head])."""
    torch.manual_seed(0)
    model = TinyLM(vocab=vocab, units=units)
    mesh = init_device_mesh("cpu", layout, mesh_dim_names=mesh_names)
    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, dtype), reduce_dtype=getattr(torch, dtype)) if dtype else \
        MixedPrecisionPolicy()
    target = mesh if mode == "native" else mesh[mesh_names[1]]
    if units == "joint":
        fully_shard([model.norm, model.head], mesh=target, mp_policy=mp)
    elif units == "tied":
        fully_shard([model.emb, model.head], mesh=target, mp_policy=mp)
    for block in model.blocks:
        fully_shard(block, mesh=target, mp_policy=mp)
    fully_shard(model, mesh=target, mp_policy=mp)
    state = register_edgc(model, mesh, EDGCConfig.from_dict(config)) if mode == "edgc" else None
    return model, state, mesh


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def train(rank: int, world: int, mode: str, config: dict | None, steps: int,
          options: dict | None = None) -> dict[str, Any]:
    """Train `steps` steps; `options`: "accum" micro-batches a step (synced on the last one
    as with native HSDP: set_requires_all_reduce), "dtype" of MixedPrecisionPolicy,
    "stop_at" a step to save a checkpoint at (model, optimiser, EDGC state; returned),
    "resume" one such checkpoint per rank to start from, "layout" (replicate, shard),
    "vocab" the embedding's and head's rows (the batches' tokens stay below VOCAB), "units"
    how the ends are sharded (TinyLM: "apart", "joint", "tied"), "off"
    the steps with EDGC switched off (state.enabled False).
    Returns the full parameters, the losses, the ranks and the stats."""
    options = options or {}
    accum, dtype, stop_at = options.get("accum", 1), options.get("dtype"), options.get("stop_at")
    resume, layout = options.get("resume"), options.get("layout", (2, 2))
    model, state, mesh = build(mode, layout, config, dtype, vocab=options.get("vocab", VOCAB),
                               units=options.get("units", "apart"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start = 0
    if resume is not None:
        ckpt = torch.load(io.BytesIO(resume[rank]), weights_only=False)
        for name, p in model.named_parameters():
            p.data.copy_(ckpt["local"][name])
        opt.load_state_dict(ckpt["opt"])
        if state is not None:
            state.load_state_dict(ckpt["edgc"])
        start = ckpt["step"]
    losses, ranks, saved = [], [], None
    shard = mesh["shard"].get_local_rank()
    replica = mesh["replicate"].get_local_rank()
    for step in range(start, steps):
        if state is not None:
            state.enabled = step not in options.get("off", ())
        for micro in range(accum):
            last = micro == accum - 1
            model.set_requires_all_reduce(last)
            idx, target = batch(step, micro, rank)
            logits = model(idx)
            loss = F.cross_entropy(logits.float().flatten(0, 1), target.reshape(-1)) / accum
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if state is not None:
            ranks.append(state.stats().step_rank)
        if stop_at is not None and step + 1 == stop_at:
            buf = io.BytesIO()
            torch.save({"step": stop_at, "local": {n: p.data.clone() for n, p in model.named_parameters()},
                        "opt": opt.state_dict(), "edgc": state.state_dict() if state is not None else None}, buf)
            saved = buf.getvalue()
    out = {"params": full_params(model), "losses": losses, "ranks": ranks, "saved": saved,
           "coords": (replica, shard)}
    if state is not None:
        out["stats"] = state.stats()
        out["state"] = state.sync.state_dict()
    dist.barrier()
    return out


def refusal(rank: int, world: int, case: str) -> str:
    """The message register_edgc (or the first step) raises for `case`; '' if none."""
    try:
        if case == "native":
            model, _, mesh = build("native", (2, 2), None)
            register_edgc(model, mesh, EDGCConfig(max_rank=4))
        elif case == "mesh-names":
            torch.manual_seed(0)
            model = TinyLM()
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "fsdp"))
            fully_shard(model, mesh=mesh["fsdp"])
            register_edgc(model, mesh, EDGCConfig(max_rank=4))
        elif case == "no-fsdp":
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            register_edgc(TinyLM(), mesh, EDGCConfig(max_rank=4))
        elif case == "calibrate":
            build("edgc", (2, 2), dict(max_rank=None))
        elif case == "buffer-size":
            model, _, _ = build("edgc", (2, 2), dict(max_rank=4, warmup_steps=1, window=2))
            idx, target = batch(0, 0, rank)
            # the head's weight left out of the step: the root module's buffer is smaller
            model.skip_head = True
            model(idx).sum().backward()
        elif case == "layout":
            model, state, _ = build("edgc", (2, 2), dict(max_rank=4))
            d = state.state_dict()
            d["layout"] = [1, 4]
            state.load_state_dict(d)
        else:
            raise ValueError(case)
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        dist.barrier()
    return ""


def dcp_round_trip(rank: int, world: int, config: dict, steps: int, path: str) -> dict[str, Any]:
    """Train, save the EDGC state with torch.distributed.checkpoint, load it into a fresh
    state through DCP; returns both states' inner dicts."""
    import torch.distributed.checkpoint as dcp

    model, state, _ = build("edgc", (2, 2), config)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        idx, target = batch(step, 0, rank)
        F.cross_entropy(model(idx).reshape(-1, VOCAB), target.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    dcp.save({"edgc": state.state_dict()}, checkpoint_id=path)
    _, fresh, _ = build("edgc", (2, 2), config)
    template = {"edgc": fresh.state_dict()}
    dcp.load(template, checkpoint_id=path)
    fresh.load_state_dict(template["edgc"])
    dist.barrier()
    return {"saved": state.sync.state_dict(), "loaded": fresh.sync.state_dict()}
