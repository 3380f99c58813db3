"""What the data-parallel and the pipeline trainers share: schedule, optimiser groups,
model identity for checkpoints, and restoring one rank's state on resume."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from edgc.models import build_model
from edgc.train.config import TrainConfig

__all__ = ["lr_at", "model_config", "param_groups", "restore_rank"]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate at `step` (1-based): linear warm-up, then cosine decay to min_lr."""
    assert cfg.lr_warmup_steps is not None and cfg.min_lr is not None
    if step <= cfg.lr_warmup_steps:
        return cfg.lr * step / max(1, cfg.lr_warmup_steps)
    progress = (step - cfg.lr_warmup_steps) / max(1, cfg.steps - cfg.lr_warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))) * (cfg.lr - cfg.min_lr)


def model_config(cfg: TrainConfig, vocab_size: int) -> dict[str, Any]:
    """The model's GPTConfig as a dict, for matching checkpoints (built on meta: free)."""
    model = build_model(cfg.preset, vocab_size=vocab_size, block_size=cfg.block_size, device="meta")
    return dataclasses.asdict(model.config)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices and embeddings, none on biases and norms (GPT-2 practice)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def restore_rank(ckpt: dict[str, Any], rank: int, weights: dict[str, Any], module: torch.nn.Module,
                 opt: torch.optim.Optimizer, hook_state: Any, gen: torch.Generator) -> int:
    """Load `weights` ({"model", "optimizer"}) and this rank's compression state, batch
    generator and RNG from a checkpoint; returns the step it was taken at."""
    module.load_state_dict(weights["model"])
    opt.load_state_dict(weights["optimizer"])
    mine = ckpt["replicas"][rank]
    hook_state.load_state_dict(mine["comm"])
    gen.set_state(mine["generator"])
    torch.set_rng_state(mine["torch_rng"])
    return int(ckpt["step"])
