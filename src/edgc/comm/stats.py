"""`EDGCStats`, what a synchroniser has done so far, and `log_stats`, which sends them to any
logger every N steps of your own loop.

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
from dataclasses import dataclass
from typing import Any

__all__ = ["EDGCStats", "log_stats"]

logger = logging.getLogger(__name__)


@dataclass
class EDGCStats:
    """What the compressor has done so far on this replica."""

    step: int
    phase: str  # "warmup" (uncompressed, maybe calibrating) or "compress", from the next step on
    rank: int  # rank in use from the next step on; 0 while uncompressed
    step_phase: str  # the phase the last synchronised step ran in ("warmup" before any)
    step_rank: int  # the rank the last step was sent at; 0 if it went uncompressed
    entropy: float  # last replica-averaged entropy estimate (nan before the first)
    min_rank: int  # r_min; 0 until known
    max_rank: int  # r_max; 0 until known (calibration)
    bytes_sent: int  # bytes this replica handed to collectives
    bytes_uncompressed: int  # bytes plain DDP all-reduce would have handed over
    compress_seconds: float  # local compression arithmetic (P, Q, orthogonalisation, EF)
    comm_seconds: float  # time spent waiting for collectives (pipelined: the part the backward pass did not hide)
    entropy_seconds: float  # sampling and entropy estimation
    nonfinite_steps: int  # compressed steps whose gradient had inf/nan (sent on; EF and Q kept as they were)
    compressed_steps: int  # steps synchronised with low-rank compression
    # from the policy's report (RankPolicy.report): "critical", at the last window end; nan (False) before one
    critical_rho: float = math.nan  # rho = |N_old - N_new| / N_old (nan: no earlier window to compare)
    window_norm: float = math.nan  # N: the norm of the window's mean averaged gradient, on the GDS sample
    lr_drop: bool = False  # the learning rate dropped in that window (set_learning_rate), agreed over replicas
    # the last window's gradient noise scale B_simple (McCandlish et al. 2018) in units of one
    # replica's batch: multiply by that batch's size for examples. Measured on sampled steps
    # of the policies that sample the gradient (all but static and schedule); biased high
    # on compressed steps, whose average is the low-rank one
    # (edgc.comm.windowgrad); nan with one replica, or before the first window end
    noise_scale: float = math.nan
    # bytes this replica's compression state holds now: Q, the error feedback (one buffer),
    # the step's workspace, empty between steps (CompressionState.nbytes), and the
    # window's sums of the averaged gradient's sample (WindowGradient.nbytes); the model's
    # parameters and gradients are not in it. 0 before compression starts (but for those sums)
    state_bytes: int = 0

    @property
    def compression_ratio(self) -> float:
        """bytes_uncompressed / bytes_sent (1.0 before any step)."""
        return self.bytes_uncompressed / self.bytes_sent if self.bytes_sent else 1.0

    def scalars(self) -> dict[str, float]:
        """These stats as numbers for a metrics logger (edgc.comm.stats.log_stats): "rank"
        and "compressing" (1 or 0) say what the last step did (step_rank, step_phase), as
        metrics.jsonl does; then "entropy" (left out before the first estimate), "min_rank",
        "max_rank", the byte counts so far and their "compression_ratio", the seconds spent,
        the counts of compressed and non-finite steps, the compression state's
        "state_bytes", and where measured "critical_rho",
        "window_norm", "lr_drop" (1 or 0, from the first "critical" window end on) and
        "noise_scale"; values not measured yet (nan) are left out."""
        out = {
            "rank": float(self.step_rank), "compressing": float(self.step_phase == "compress"),
            "entropy": self.entropy, "min_rank": float(self.min_rank), "max_rank": float(self.max_rank),
            "bytes_sent": float(self.bytes_sent), "bytes_uncompressed": float(self.bytes_uncompressed),
            "compression_ratio": self.compression_ratio, "compress_seconds": self.compress_seconds,
            "comm_seconds": self.comm_seconds, "entropy_seconds": self.entropy_seconds,
            "compressed_steps": float(self.compressed_steps), "nonfinite_steps": float(self.nonfinite_steps),
            "critical_rho": self.critical_rho, "window_norm": self.window_norm,
            "lr_drop": float(self.lr_drop) if math.isfinite(self.window_norm) else math.nan,
            "noise_scale": self.noise_scale, "state_bytes": float(self.state_bytes),
        }
        return {name: value for name, value in out.items() if math.isfinite(value)}


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
