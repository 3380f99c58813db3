"""EDGC under a Lightning Trainer: one callback registers the hook, checkpoints every
replica's state and logs the stats.

    from edgc import EDGCConfig
    from edgc.integrations.lightning import EDGCCallback

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp",
                        callbacks=[EDGCCallback(EDGCConfig(max_rank=32))])

Why a Callback, not a DDPStrategy subclass. A callback works with whichever DDP strategy
the user already has ("ddp", "ddp_spawn", a DDPStrategy with its own settings), and it
is where Lightning offers all three things needed: a moment after the DDP wrapper exists
(on_fit_start), a slot in the checkpoint (state_dict/load_state_dict, which Lightning
calls on every rank) and the logger (pl_module.log_dict). A strategy subclass would
have to be chosen instead of the user's strategy and would still need the other two.
Lightning's own `DDPStrategy(ddp_comm_hook=...)` registers a hook only on CUDA, so on a
CPU it never runs; the callback registers on every device, inside each worker.

The learning rate. Before each training batch (on_train_batch_start, so before its
backward pass) the callback tells the state the learning rate of the trainer's
optimizers: the largest among their param groups (edgc.integrations._tell_learning_rate).
Lightning steps a scheduler of interval "step" after the optimizer step, so that is the
rate of the step whose gradient the hook syncs next. With policy="critical" the window
after a learning-rate drop then runs at r_max.

Checkpoints. Lightning writes what rank 0 holds, so state_dict() gathers every
replica's EDGC state to rank 0 (a collective: Lightning dumps the checkpoint on every
rank), and on resume each rank loads its own entry (edgc.checkpoint). A checkpoint of
another world size is refused with both sizes named.

This targets the `lightning` package (`import lightning as L`); the older
`pytorch_lightning` package has its own Callback class, which Trainers of that package
require.
"""

from __future__ import annotations

import logging
from typing import Any

from edgc.integrations import _register, _require, _tell_learning_rate, log_values

_require("lightning", "lightning", "edgc.integrations.lightning")

import lightning as L  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from edgc.checkpoint import gather_states, restore_state  # noqa: E402
from edgc.comm import EDGCState  # noqa: E402
from edgc.config import EDGCConfig  # noqa: E402

logger = logging.getLogger(__name__)

__all__ = ["EDGCCallback"]


class EDGCCallback(L.Callback):
    """Compress the DDP gradient with EDGC in a Lightning Trainer.

    `self.state` is the EDGCState (read `callback.state.stats()` at any time). With
    `log_stats`, every training batch logs rank, entropy, phase, compression ratio and
    bytes sent (edgc.integrations.log_values) through `pl_module.log_dict`, so they
    reach whatever logger the Trainer has, at its `log_every_n_steps`.

    Before every training batch it tells the state the learning rate the step will use
    (EDGCState.set_learning_rate): the largest rate among the param groups of all of
    `trainer.optimizers` (one optimizer with one group: its rate). A scheduler scales
    every group alike, so the largest falls with the rest; with several optimizers
    (manual optimisation) a drop is seen when the fastest one's rate falls.
    """

    def __init__(self, config: EDGCConfig | None = None, *, process_group: dist.ProcessGroup | None = None,
                 log_stats: bool = True) -> None:
        # (built here, maybe before the process group: the state binds its group at its first step)
        self.state = EDGCState(process_group, config)
        self.log_stats = log_stats
        self._ddp: DistributedDataParallel | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Register edgc_hook on the DDP wrapper, which the strategy has built by now."""
        ddp = trainer.strategy.model
        if ddp is self._ddp:
            return  # (a second fit() on the same wrapper)
        if isinstance(ddp, DistributedDataParallel) and getattr(trainer.strategy, "_ddp_comm_hook", None) is not None:
            raise ValueError("DDPStrategy(ddp_comm_hook=...) and EDGCCallback would both register a communication "
                             "hook; drop ddp_comm_hook (EDGCCallback registers edgc_hook on every device)")
        if _register(ddp, self.state, trainer.world_size, "EDGCCallback",
                     wrapper_hint=f"the {type(trainer.strategy).__name__} strategy is not DDP; use strategy='ddp' "
                                  "(or another DDPStrategy)",
                     unused_hint="use strategy='ddp', whose default is False"):
            self._ddp = ddp

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        """Tell the state this step's learning rate, before its backward pass."""
        _tell_learning_rate(self.state, trainer.optimizers)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.log_stats and self.state.step > 0:
            # (every replica logs the same values: they come from agreed decisions and
            # all-reduced entropies; no sync needed)
            pl_module.log_dict(log_values(self.state.stats()), on_step=True, on_epoch=False, batch_size=1)

    def state_dict(self) -> dict[str, Any]:
        """Every replica's EDGC state on rank 0 (None elsewhere: Lightning's DDP strategy
        writes rank 0's checkpoint). Every rank must call it, as Lightning does."""
        return {"replicas": gather_states(self.state)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load this rank's own EDGC state from the checkpoint's list (every rank reads it)."""
        states = state_dict.get("replicas")
        if states is None:
            raise ValueError("this checkpoint's EDGC entry holds no replica states: it was written by a rank other "
                             "than 0, which Lightning's DDP strategy does not do")
        restore_state(self.state, states)

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if self.state_key not in (checkpoint.get("callbacks") or {}):
            logger.warning("the checkpoint holds no EDGC state (it was saved without EDGCCallback, or with "
                           "save_weights_only): EDGC starts again from warm-up")
