"""Worker functions for the distributed tests (importable by spawned processes)."""

from __future__ import annotations

import copy
import io

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from edgc import EDGCConfig, EDGCState, edgc_hook


class MixedNet(nn.Module):
    """Linear, embedding, conv and 1-D parameters, enough for several small DDP buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 48)
        self.conv = nn.Conv1d(48, 40, kernel_size=3, padding=1)
        self.norm = nn.LayerNorm(40)
        self.fc1 = nn.Linear(40, 96)
        self.fc2 = nn.Linear(96, 64)
        self.scale = nn.Parameter(torch.ones(64))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)  # (B, T, 48)
        x = self.conv(x.transpose(1, 2)).transpose(1, 2)  # (B, T, 40)
        x = self.norm(F.gelu(x))
        x = self.fc2(F.gelu(self.fc1(x)))  # (B, T, 64)
        return x * self.scale


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    idx = torch.randint(0, 64, (4, 12), generator=g)
    target = torch.roll(idx, shifts=1, dims=1)
    return idx, target


def _make(config: EDGCConfig, seed: int = 0, bucket_cap_mb: float = 0.02):
    torch.manual_seed(seed)
    model = MixedNet()
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    state = EDGCState(process_group=None, config=config)
    ddp.register_comm_hook(state, edgc_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    return model, ddp, state, opt


def _train(ddp, opt, state, rank: int, start: int, steps: int):
    losses, ranks = [], []
    for step in range(start, start + steps):
        idx, target = _batch(step, rank)
        loss = F.cross_entropy(ddp(idx).reshape(-1, 64), target.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grads_finite = all(bool(torch.isfinite(p.grad).all()) for p in ddp.parameters())
        if grads_finite:
            opt.step()
        losses.append(float(loss.detach()))
        ranks.append(state.stats().rank)
    return losses, ranks


def train_and_report(rank: int, world: int, config_kwargs: dict, steps: int) -> dict:
    """Train MixedNet; return flattened parameters, losses, ranks and stats."""
    config = EDGCConfig(**config_kwargs)
    model, ddp, state, opt = _make(config)
    losses, ranks = _train(ddp, opt, state, rank, 0, steps)
    n_buckets = len(ddp.reducer._get_zeros_like_grad_buckets()) if hasattr(ddp.reducer, "_get_zeros_like_grad_buckets") else -1
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"params": flat, "losses": losses, "ranks": ranks, "stats": state.stats(), "buckets": n_buckets, "history": list(state.controller.history)}


def resume_check(rank: int, world: int, config_kwargs: dict, n: int) -> dict:
    """2n straight steps vs n steps, checkpoint through bytes, fresh objects, n more."""
    config = EDGCConfig(**config_kwargs)
    model, ddp, state, opt = _make(config)
    straight, _ = _train(ddp, opt, state, rank, 0, 2 * n)
    straight_params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    model, ddp, state, opt = _make(config)
    first, _ = _train(ddp, opt, state, rank, 0, n)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "edgc": state.state_dict()}, buf)
    del model, ddp, state, opt
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    model, ddp, state, opt = _make(config, seed=123)  # different init: everything must come from the checkpoint
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    state.load_state_dict(ckpt["edgc"])
    second, _ = _train(ddp, opt, state, rank, n, n)
    resumed_params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {
        "straight": straight,
        "resumed": first + second,
        "straight_params": straight_params,
        "resumed_params": resumed_params,
    }


def nonfinite_check(rank: int, world: int, config_kwargs: dict, bad_step: int, steps: int) -> dict:
    """Inject inf into one replica's gradient at bad_step; EF and Q must stay finite."""
    config = EDGCConfig(**config_kwargs)
    model, ddp, state, opt = _make(config)
    finite_after_bad = None
    skipped = 0
    for step in range(steps):
        idx, target = _batch(step, rank)
        out = ddp(idx)
        if step == bad_step and rank == world - 1:
            out = out * float("inf")
        loss = F.cross_entropy(out.reshape(-1, 64), target.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if all(bool(torch.isfinite(p.grad).all()) for p in ddp.parameters()):
            opt.step()
        else:
            skipped += 1
        if step == bad_step:
            finite_after_bad = all(
                bool(torch.isfinite(g.q).all()) and (g.error is None or bool(torch.isfinite(g.error).all()))
                for g in state.groups.values()
            )
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"skipped": skipped, "buffers_finite": finite_after_bad, "stats": state.stats(), "params": flat}


def mismatch_check(rank: int, world: int) -> str:
    """Loading a state from another model must raise a clear error at the first step."""
    config = EDGCConfig(policy="static", max_rank=4, warmup_steps=0, warmup_error_check=False)
    model, ddp, state, opt = _make(config)
    _train(ddp, opt, state, rank, 0, 2)
    saved = copy.deepcopy(state.state_dict())

    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(10, 20), nn.Linear(20, 3))
    ddp2 = DDP(other)
    state2 = EDGCState(None, config)
    state2.load_state_dict(saved)
    ddp2.register_comm_hook(state2, edgc_hook)
    try:
        ddp2(torch.randn(4, 10)).sum().backward()
    except Exception as exc:  # the hook's error surfaces through backward
        return str(exc)
    return "no error"


def train_plain(rank: int, world: int, steps: int) -> dict:
    """The same training with DDP's built-in all-reduce, for comparison."""
    torch.manual_seed(0)
    model = MixedNet()
    ddp = DDP(model, bucket_cap_mb=0.02)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    for step in range(steps):
        idx, target = _batch(step, rank)
        loss = F.cross_entropy(ddp(idx).reshape(-1, 64), target.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}
