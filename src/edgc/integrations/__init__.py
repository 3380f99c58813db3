"""Thin adapters for the training frameworks users already run.

- `edgc.integrations.lightning`: `EDGCCallback` for a Lightning Trainer
  (`pip install "edgc[lightning]"`).
- `edgc.integrations.hf`: `EDGCTrainerCallback` for the Trainer from transformers, and
  `register_edgc` for an Accelerate `Accelerator` (`pip install "edgc[hf]"`).
- `edgc.integrations.torchtitan`: torchtitan's trainer with its HSDP replicate sync through
  `edgc.fsdp` (`--module edgc.integrations.torchtitan`, `with_edgc`;
  `pip install "edgc[torchtitan]"`).

Each adapter does what a user would otherwise write by hand: register edgc_hook once
the process group and the DDP wrapper exist, keep every replica's EDGC state in the
framework's checkpoint and give each replica its own back (edgc.checkpoint), and send
the stats to the framework's logs. Each is importable only when its framework is
installed; this package itself imports none.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeGuard

from edgc.comm.hook import EDGCState, EDGCStats, edgc_hook

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel
    from torch.optim import Optimizer

logger = logging.getLogger(__name__)

__all__ = ["log_values"]


#: The EDGCStats.scalars() a framework's log shows each step.
_LOGGED = ("rank", "compressing", "compression_ratio", "bytes_sent", "entropy")


def log_values(stats: EDGCStats, prefix: str = "edgc/") -> dict[str, float]:
    """The stats a training log shows, as floats keyed `prefix` + name: the rank the last
    step was sent at (0: uncompressed), whether it was compressed (1.0) or not (0.0),
    the replica-averaged entropy (left out before the first estimate), the compression
    ratio so far (bytes plain all-reduce would have sent / bytes sent) and bytes sent."""
    scalars = stats.scalars()
    return {prefix + name: scalars[name] for name in _LOGGED if name in scalars}


def _register(ddp: Any, state: EDGCState, world_size: int, who: str, *, wrapper_hint: str,
              unused_hint: str) -> TypeGuard[DistributedDataParallel]:
    """Register edgc_hook on `ddp`, the framework's DDP wrapper; returns True then (`ddp`
    is a DDP), False (with a warning) for a single process that has no DDP wrapper, and
    raises for any other wrapper. `wrapper_hint` and `unused_hint` say how to fix the
    wrapper and how to turn off find_unused_parameters in the caller's framework."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp, DistributedDataParallel):
        if world_size > 1:
            raise TypeError(f"{who} compresses DDP's gradient all-reduce, and the model is wrapped in "
                            f"{type(ddp).__name__}; {wrapper_hint}")
        logger.warning("%s: a single process without DDP sends no gradients, so EDGC does nothing", who)
        return False
    if ddp.find_unused_parameters:
        logger.warning("%s: DDP has find_unused_parameters=True, which costs a graph traversal per step; EDGC needs "
                       "every parameter's gradient at every step anyway (%s)", who, unused_hint)
    ddp.register_comm_hook(state, edgc_hook)
    return True


def _tell_learning_rate(state: EDGCState, optimizers: Iterable[Optimizer]) -> float | None:
    """Give `state` the learning rate of the step about to run: the largest rate among the
    param groups of `optimizers`, as they stand now (before this step's optimizer.step(),
    so after the scheduler's step for the previous one). Returns that rate, or None (the
    state told nothing) when no group has one (an optimizer that sizes its own steps,
    such as Adafactor with lr=None).

    Why the largest: a scheduler scales every group alike, so the largest falls with the
    rest, while a group held at 0 (frozen) would make the least rate 0 for good, and no
    later rate could fall below it. So a drop is seen when the fastest group's rate falls.
    """
    rates = [float(group["lr"]) for optimizer in optimizers for group in optimizer.param_groups
             if group.get("lr") is not None]
    if not rates:
        return None
    lr = max(rates)
    state.set_learning_rate(lr)
    return lr


def _require(module: str, extra: str, what: str) -> None:
    """Import `module`, or raise ImportError saying which extra installs it."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{what} needs {module!r}, which could not be imported ({exc}); install it with: "
                          f"pip install \"edgc[{extra}]\"") from exc
