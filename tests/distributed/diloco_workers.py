"""Worker functions for the DiLoCo tests: a user's own loop with edgc.diloco.DiLoCo, as the
module doc writes it (importable by spawned processes)."""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from edgc import EDGCConfig
from edgc.diloco import DiLoCo


def _model() -> nn.Module:
    torch.manual_seed(0)  # (the same start on every replica)
    return nn.Sequential(nn.Embedding(40, 24), nn.Flatten(), nn.Linear(24 * 6, 64), nn.GELU(), nn.Linear(64, 40))


def _digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def train(rank: int, world: int, inner_steps: int, steps: int, compression: dict | None,
          stop_at: int | None = None, resume: list[dict] | None = None) -> dict[str, Any]:
    """`steps` inner steps of AdamW with DiLoCo; each replica its own batches. Returns the
    digest of the weights after every outer step, the stats, and (at `stop_at`) this
    replica's saved model, optimiser and DiLoCo state; `resume`: such saves, one per rank,
    to start from."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    diloco = DiLoCo(model, opt, inner_steps=inner_steps,
                    compression=EDGCConfig.from_dict(compression) if compression else None)
    start = 0
    if resume is not None:
        mine = resume[rank]
        model.load_state_dict(mine["model"])
        opt.load_state_dict(mine["opt"])
        diloco.load_state_dict(mine["diloco"])
        start = mine["step"]
    digests, losses, saved = {}, [], None
    for step in range(start, steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randint(0, 40, (8, 6), generator=g)
        loss = nn.functional.cross_entropy(model(x), x[:, 0])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if diloco.step():
            digests[step + 1] = _digest(model)
        if stop_at is not None and step + 1 == stop_at:
            saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                     "opt": copy.deepcopy(opt.state_dict()), "diloco": diloco.state_dict(), "step": stop_at}
    dist.barrier()
    return {"digests": digests, "losses": losses, "stats": diloco.stats(), "saved": saved, "final": _digest(model),
            "weights": [p.detach().clone() for p in model.parameters()]}
