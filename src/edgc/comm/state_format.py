"""The format of a synchroniser's state_dict: version 2, checked on load, and the one upgrade
from version 1 (edgc 0.1).

Version 2 groups the state by owner:

    format, version, world_size, replica, config (EDGCConfig.to_dict)
    step, phase, applied_rank, stage_uncompressed, step_phase, step_rank, r_min, r_max
    compression      CompressionState: slots, groups (Q, error feedback), plan, generator
    policy           {"name", "state"}: the rank policy's own state
    entropy          the entropy windows (edgc.policy.window.EntropyWindow)
    window_gradient  the window's averaged-gradient sums (edgc.comm.windowgrad)
    gate, calibration, alignment (a pipeline stage's DAC, or None), stats
"""

from __future__ import annotations

import math
from typing import Any

from edgc.config import upgrade_config_v1
from edgc.policy.base import RankPolicy
from edgc.policy.registry import policy_class

__all__ = ["FORMAT", "VERSION", "check_state", "upgrade_v1"]

FORMAT = "edgc-state"
VERSION = 2

# Keys every state_dict() of version 2 has, the tables among them, and what its "stats" hold.
_REQUIRED = ("world_size", "replica", "config", "step", "phase", "applied_rank", "stage_uncompressed", "step_phase",
             "step_rank", "r_min", "r_max", "compression", "policy", "entropy", "window_gradient", "gate",
             "calibration", "alignment", "stats")
_TABLES = ("config", "compression", "policy", "entropy", "gate", "calibration", "stats")
_STATS = ("last_entropy", "bytes_sent", "bytes_uncompressed", "compress_seconds", "comm_seconds", "entropy_seconds",
          "grad_scale", "nonfinite_steps", "compressed_steps", "noise_scale")
_COMPRESSION = ("slot_shapes", "uncompressed_slots", "units", "groups", "generator", "residual_pending")


def check_state(d: Any) -> dict[str, Any]:
    """`d` as a version-2 state (a version-1 one upgraded), or ValueError naming what is
    wrong: not an EDGC state, an unknown version, or a missing key (a truncated or
    hand-made state). Changes nothing in `d`."""
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise ValueError("not an EDGC state dict (missing format marker 'edgc-state')")
    if d.get("version") == 1:
        d = upgrade_v1(d)
    elif d.get("version") != VERSION:
        raise ValueError(f"EDGC state version {d.get('version')} is not supported (expected 1 or {VERSION})")
    missing = [k for k in _REQUIRED if k not in d]
    if missing:
        raise ValueError(f"EDGC state dict lacks {missing} (expected every key that state_dict() writes)")
    not_tables = [k for k in _TABLES if not isinstance(d[k], dict)]
    if not_tables:
        raise ValueError(f"EDGC state dict: {not_tables} must be tables, as state_dict() writes them")
    for table, keys in (("stats", _STATS), ("compression", _COMPRESSION), ("policy", ("name", "state"))):
        lacking = [k for k in keys if k not in d[table]]
        if lacking:
            raise ValueError(f"EDGC state dict: {table!r} lacks {lacking}")
    return d


# Keys every version-1 state has.
_V1_REQUIRED = ("world_size", "config", "step", "phase", "r_min", "r_max", "slot_shapes", "uncompressed_slots",
                "groups", "generator", "controller", "gate", "calibration", "stats")
# What a version-1 state saved before a key existed ran with.
_V1_STATS = {"grad_scale": 1.0, "nonfinite_steps": 0, "compressed_steps": 0, "noise_scale": math.nan,
             "last_entropy": math.nan}


def upgrade_v1(d: dict[str, Any]) -> dict[str, Any]:
    """A version-1 state (edgc 0.1) as version 2, resuming exactly as 0.1 would have; raises
    ValueError for a truncated one or one whose policy was removed. Changes nothing in `d`."""
    missing = [k for k in _V1_REQUIRED if k not in d]
    if missing:
        raise ValueError(f"EDGC state dict (version 1) lacks {missing}")
    not_tables = [k for k in ("config", "controller", "gate", "calibration", "stats") if not isinstance(d[k], dict)]
    if not_tables:
        raise ValueError(f"EDGC state dict: {not_tables} must be tables, as state_dict() writes them")
    lacking = [k for k in ("comm_seconds", "entropy_seconds", "compress_seconds") if k not in d["stats"]]
    if lacking:
        raise ValueError(f"EDGC state dict: 'stats' lacks {lacking}")
    config = upgrade_config_v1(d["config"])
    controller, phase = d["controller"], d["phase"]
    # (states written before pipelines existed lack the next three keys)
    applied = int(d.get("applied_rank", controller["rank"]))
    stage_uncompressed = bool(d.get("stage_uncompressed", False))
    rank_in_use = applied if phase == "compress" and not stage_uncompressed else 0
    name = config["policy"]
    policy = getattr(policy_class(name), "state_from_v1", RankPolicy.state_from_v1)(d)
    return {
        "format": FORMAT, "version": VERSION,
        "world_size": d["world_size"], "replica": d.get("replica"), "config": config,
        "step": d["step"], "phase": phase, "applied_rank": applied, "stage_uncompressed": stage_uncompressed,
        "step_phase": d.get("step_phase", phase), "step_rank": int(d.get("step_rank", rank_in_use)),
        "r_min": d["r_min"], "r_max": d["r_max"],
        "compression": {
            "slot_shapes": d["slot_shapes"], "uncompressed_slots": d["uncompressed_slots"],
            # (states before the pipelined mode lack "units": DDP's buckets serve until known)
            "units": d.get("units"), "groups": d["groups"], "generator": d["generator"],
            "residual_pending": phase == "compress",  # (flushing zeros is harmless)
        },
        "policy": {"name": name, "state": policy},
        "entropy": {k: controller[k] for k in ("window_sum", "window_count", "history")},
        "window_gradient": d.get("window_gradient"),
        "gate": d["gate"], "calibration": d["calibration"], "alignment": d.get("alignment"),
        "stats": {**_V1_STATS, **d["stats"]},
    }
