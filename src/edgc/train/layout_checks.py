"""The refusals of a layout that `edgc train` cannot serve: tensor, expert and pipeline
parallelism, FSDP2/HSDP and DiLoCo (TrainConfig.validate calls them, each refusal in one
line through its `bad`), and the experts' own EDGCConfig (TrainConfig.expert_edgc)."""

from __future__ import annotations

import math
from typing import Any

from edgc.config import EDGCConfig, flat_sections, pipeline_refusal
from edgc.models import PRESETS

__all__ = ["DILOCO_METHODS", "check_diloco_layout", "check_expert_layout", "check_hsdp_layout",
           "check_pipeline_layout", "check_tp_layout", "expert_config"]

#: The methods that sync every H steps (edgc.diloco), not every step.
DILOCO_METHODS = ("diloco", "edgc-diloco")

#: The EDGCConfig fields read by one warm-up mode only: a run's value of one is not the
#: experts' when their warm-up is another.
_READ_BY = {"warmup_min_steps": "gradient", "warmup_max_error": "gradient", "warmup_error_norm": "release-check"}


def expert_config(run: EDGCConfig, overrides: dict[str, Any]) -> EDGCConfig:
    """The experts' EDGCConfig: the run's `run` with `overrides` (EDGCConfig fields, flat
    or in sections). A field the experts' warm-up does not read is not taken from the run,
    and the run's warmup_min_steps is capped at the experts' warmup_steps (as
    TrainConfig.edgc_config caps the run's). Raises ValueError naming the field."""
    base, given = run.to_flat(), flat_sections(overrides)
    warmup = given.get("warmup", base["warmup"])
    for name, mode in _READ_BY.items():
        if warmup != mode and name not in given:
            base[name] = EDGCConfig.__dataclass_fields__[name].default
    most = given.get("warmup_steps")
    if "warmup_min_steps" not in given and isinstance(most, int) and most >= 0:
        base["warmup_min_steps"] = min(base["warmup_min_steps"], most)
    return EDGCConfig.from_dict({**base, **given})


def check_expert_layout(cfg: Any, bad: Any) -> None:
    """Refuse (through `bad`) an expert-parallel setting the run (a TrainConfig) cannot serve."""
    experts = PRESETS[cfg.preset].n_expert
    if cfg.ep > 1 and not experts:
        bad("ep", f"splits a model's experts: the {cfg.preset} preset has none (use tiny-moe or small-moe)")
    if experts and cfg.ep > 1 and experts % cfg.ep:
        bad("ep", f"must divide the {cfg.preset} preset's {experts} experts")
    if experts and cfg.tp > 1:
        bad("tp", "tensor parallelism does not split experts yet: use --ep for a preset with experts")
    if experts and cfg.pp > 1:
        bad("pp", "pipelines do not carry the experts' load-balancing loss yet: use --ep for a preset with "
                  "experts")
    if experts and cfg.compile:
        bad("compile", "is not supported with experts yet (the routing reads token counts on the host)")
    if cfg.ep_wire != "native" and cfg.ep == 1:
        bad("ep_wire", "sets the experts' all-to-all: it needs ep > 1")
    if cfg.ep > 1 and cfg.method not in ("none", "powersgd", "edgc"):
        bad("method", f"{cfg.method} is not supported with --ep: use none (native HSDP), powersgd or edgc")
    if cfg.expert_edgc:
        try:
            cfg.expert_edgc_config()
        except ValueError as exc:
            raise ValueError(f"expert_edgc: {exc}") from None
        given = ", ".join(f"{k}={v!r}" for k, v in flat_sections(cfg.expert_edgc).items())
        if not experts:
            raise ValueError(f"expert_edgc ({given}) sets the experts' compression: the {cfg.preset} preset has "
                             "none (use tiny-moe or small-moe)")
        if cfg.method not in ("powersgd", "edgc"):
            raise ValueError(f"expert_edgc ({given}) sets the experts' compression: method {cfg.method!r} "
                             "compresses nothing (use powersgd or edgc)")
        if not cfg.hsdp:
            raise ValueError(f"expert_edgc ({given}) sets the experts' own core, which an FSDP2 run has (--ep > 1, "
                             "or --dp-shard / --dp-replicate): under DDP the experts share the model's")


def check_tp_layout(cfg: Any, bad: Any) -> None:
    """Refuse (through `bad`) a tensor-parallel setting the run (a TrainConfig) cannot serve."""
    if cfg.sequence_parallel and cfg.tp == 1:
        bad("sequence_parallel", "splits the model over the TP ranks: it needs tp > 1")
    if cfg.tp == 1:
        return
    from edgc.train.tensor_parallel import check_tp

    try:
        check_tp(PRESETS[cfg.preset], cfg.tp)
    except ValueError as exc:
        bad("tp", f"{exc} (preset {cfg.preset})")
    if cfg.pp > 1 and cfg.sequence_parallel:
        bad("sequence_parallel", "is not supported with pipelines (--pp) yet")
    if cfg.compile:
        bad("compile", "is not supported with tensor parallelism (--tp) yet")
    if cfg.method not in ("none", "powersgd", "edgc"):
        bad("method", f"{cfg.method} is not supported with tensor parallelism: use none (native HSDP), "
                      "powersgd or edgc")


def check_hsdp_layout(cfg: Any, bad: Any) -> None:
    """Refuse (through `bad`) an FSDP2 / HSDP setting the run (a TrainConfig) cannot serve."""
    if not cfg.hsdp:
        return
    if cfg.pp > 1 or (cfg.dp is not None and (cfg.tp == 1 or cfg.dp_replicate is not None)):
        bad("dp_shard", "HSDP (--dp-shard, --dp-replicate) does not combine with pipelines (--pp, --dp)")
    if cfg.method not in ("none", "powersgd", "edgc"):
        bad("method", f"{cfg.method} is not supported with HSDP: use none (native HSDP), powersgd or edgc")
    if cfg.dtype == "fp16":
        bad("dtype", "fp16 is not supported with HSDP (its GradScaler does not know sharded gradients); "
                     "use bf16")
    if cfg.nproc is not None:
        cfg.hsdp_layout(cfg.nproc)


def check_pipeline_layout(cfg: Any, bad: Any) -> None:
    """Refuse (through `bad`) a pipeline setting the run (a TrainConfig) cannot serve."""
    if cfg.pp == 1:
        return
    cfg.check_layout(cfg.workers())
    layers = PRESETS[cfg.preset].n_layer
    if cfg.pp > layers:
        bad("pp", f"the {cfg.preset} preset has {layers} blocks, fewer than pp({cfg.pp}) stages")
    if cfg.method in ("torch-powersgd", "compute-only"):
        bad("method", f"{cfg.method} is not supported with pp > 1 (use powersgd, our static-rank "
                      "compressor, or none)")
    if (why := pipeline_refusal(cfg.edgc_config())) is not None:
        bad("edgc", why)
    if cfg.grad_accum != 1:
        bad("grad_accum", "must be 1 with pp > 1: the pipeline's micro-batches already accumulate")
    if cfg.dtype != "fp32":
        bad("dtype", "mixed precision is not supported with pp > 1 yet (the stages exchange fp32 activations)")
    mb = cfg.microbatches or 2 * cfg.pp
    if cfg.batch_size % mb:
        raise ValueError(f"batch_size={cfg.batch_size} must divide into microbatches={mb}")
    if cfg.schedule == "1f1b" and mb < cfg.pp:
        raise ValueError(f"microbatches={mb}: the 1f1b schedule needs at least pp({cfg.pp}) micro-batches")


def check_diloco_layout(cfg: Any, bad: Any) -> None:
    """Refuse (through `bad`) DiLoCo's settings out of range, and the layouts it does not
    serve (one process per replica), for the run (a TrainConfig)."""
    h = cfg.diloco_inner_steps
    if h is not None and (isinstance(h, bool) or not isinstance(h, int) or h < 1):
        bad("diloco_inner_steps", "must be an integer >= 1 or null (steps // 100)")
    if not (math.isfinite(cfg.diloco_outer_lr) and cfg.diloco_outer_lr > 0):
        bad("diloco_outer_lr", "must be a finite number > 0 (the paper's 0.7)")
    if not 0 <= cfg.diloco_outer_momentum < 1:
        bad("diloco_outer_momentum", "must be in [0, 1) (the paper's 0.9)")
    if cfg.method not in DILOCO_METHODS:
        return
    for name, on in (("pp", cfg.pp > 1), ("tp", cfg.tp > 1), ("dp_shard", cfg.hsdp), ("ep", cfg.ep > 1)):
        if on:
            bad(name, f"--method {cfg.method} runs one process per replica: pipelines, tensor parallelism, "
                      "FSDP2/HSDP and expert parallelism are not built for DiLoCo")
    if cfg.dtype == "fp16":
        bad("dtype", f"--method {cfg.method} does not take fp16's GradScaler yet; use bf16 or fp32")
