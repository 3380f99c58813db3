"""`log_stats`: send a hook state's stats to any logger every N steps of your own loop.

torch's PowerSGD hook logs its compression rate every `compression_stats_logging_frequency`
iterations, to Python's logging only. Here the loop asks, once per step:

    state = EDGCState(None, EDGCConfig(max_rank=32))
    ddp.register_comm_hook(state, edgc_hook)
    for x, y in loader:
        loss_fn(ddp(x), y).backward()
        opt.step()
        log_stats(state, every=100)                            # an INFO line, as torch's hook
        if dist.get_rank() == 0:
            log_stats(state, every=100, log=wandb.log)         # or any log(scalars, step)

It collects nothing (no collective): each replica reports its own counters, so call it on
rank 0 for a logger that wants one writer.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

__all__ = ["log_stats"]

logger = logging.getLogger(__name__)


def log_stats(state: Any, every: int, log: Callable[[dict[str, float], int], Any] | None = None,
              prefix: str = "edgc/") -> bool:
    """Send `state.stats()` to `log` when the state's step (the steps it has synchronised)
    is a multiple of `every`; returns whether it did.

    Call it once per optimiser step, after the backward pass (after `opt.step()`, say).
    `log(scalars, step)` gets EDGCStats.scalars() with `prefix` before each name
    ("edgc/rank", "edgc/entropy", "edgc/compression_ratio", ...) and the state's step: the
    calling convention of `wandb.log`, `mlflow.log_metrics` and a Lightning logger's
    `log_metrics`. With `log` None, one INFO line goes to this module's logger
    ("edgc.comm.stats"). `state` is an EDGCState, or any state whose stats() returns
    EDGCStats (those of edgc.comm.baselines). Raises ValueError unless `every` is a
    positive integer.
    """
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"log_stats: every={every!r} must be a positive integer (steps between reports)")
    stats = state.stats()
    if stats.step == 0 or stats.step % every:
        return False
    if log is None:
        sent = f"compressed at rank {stats.step_rank}" if stats.step_phase == "compress" else "sent whole (warm-up)"
        entropy = f"{stats.entropy:.3f}" if math.isfinite(stats.entropy) else "not estimated yet"
        logger.info("EDGC step %d: %s, entropy %s; so far %.3g MB sent, %.2fx fewer bytes than uncompressed",
                    stats.step, sent, entropy, stats.bytes_sent / 1e6, stats.compression_ratio)
    else:
        log({prefix + name: value for name, value in stats.scalars().items()}, stats.step)
    return True
