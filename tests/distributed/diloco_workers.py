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


def int4_error_feedback(rank: int, world: int, steps: int) -> dict[str, Any]:
    """edgc-diloco on the int4 wire with a float64 model, H = 2: at every outer step, what
    this replica handed the core (M = Δ less the prediction, plus its kept error), the
    average the core applied, and the error kept after it; and the whole tensors' slots."""
    model = _model().double()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    config = EDGCConfig(max_rank=4, min_rank=2, window=2, warmup="fixed", warmup_steps=1, wire="int4",
                        iteration_sample_rate=1.0)
    diloco = DiLoCo(model, opt, inner_steps=2, compression=config)
    sent: list[torch.Tensor] = []
    applied: list[torch.Tensor] = []
    receive = diloco.sync.receive

    def recording(delta, entries, future, last):
        sent.append(delta.clone())
        receive(delta, entries, future, last)
        applied.append(delta.clone())

    diloco.sync.receive = recording
    kept = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randint(0, 40, (8, 6), generator=g)
        nn.functional.cross_entropy(model(x), x[:, 0]).backward()
        opt.step()
        opt.zero_grad()
        if diloco.step():
            assert diloco.error is not None
            kept.append(diloco.error.clone())
    dist.barrier()
    return {"sent": sent, "applied": applied, "kept": kept, "stats": diloco.stats(),
            "core_error_feedback": diloco.sync.config.use_error_feedback,
            "sizes": [p.numel() for p in model.parameters()]}
