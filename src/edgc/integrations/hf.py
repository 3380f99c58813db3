"""EDGC with Hugging Face: a callback for the Trainer from transformers, and a helper for
an Accelerate `Accelerator`.

    # the Trainer
    trainer = Trainer(model=model, args=TrainingArguments(..., ddp_find_unused_parameters=False), ...)
    edgc = EDGCTrainerCallback(EDGCConfig(max_rank=32)).attach(trainer)
    trainer.train()                        # or train(resume_from_checkpoint=...)

    # Accelerate
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = register_edgc(accelerator, model, EDGCConfig(max_rank=32), optimizer=optimizer)
    ...
    accelerator.log(log_values(state.stats()), step=step)
    accelerator.save_state(folder)         # and accelerator.load_state(folder) on resume

Both register edgc_hook after `prepare` has built the DDP wrapper: Accelerate's
`DistributedDataParallelKwargs(comm_hook=...)` knows only torch's own hooks and ignores
any other without an error, and the Trainer builds its wrapper inside train().

The learning rate. Both tell the state the learning rate of each step before its
backward pass (EDGCState.set_learning_rate; with policy="critical" the window after a
drop runs at r_max): the largest rate among the optimizer's param groups
(edgc.integrations._tell_learning_rate), read before the step's optimizer.step(), so
after the scheduler has stepped for the previous one. The Trainer hands its optimizer
to every callback event; on_step_begin runs once per optimizer step, before the first
of its `gradient_accumulation_steps` micro-batches. Accelerate has no per-step event,
so register_edgc(..., optimizer=optimizer) adds a forward pre-hook on the DDP wrapper:
each forward reads the rate, and a backward follows its forward. (A step pre-hook on
the optimizer would come too late: optimizer.step() runs after the backward pass has
synced the gradient, so each rate would reach the state one step after its gradient,
and a drop at a window's last step would count in the next window; nor does
Accelerate's AcceleratedOptimizer take one.) Without `optimizer` the state sees no rate
unless you call `state.set_learning_rate(lr)`.

Checkpoints. Every replica's state is gathered to rank 0 and written as edgc_state.pt
in the framework's checkpoint folder (edgc.checkpoint); on resume every replica reads it
and loads its own entry. `accelerator.register_for_checkpointing(state)` would not do:
Accelerate saves rank 0's state_dict() and loads it into every rank, and each replica's
error feedback is its own (EDGCState refuses another replica's state).

Why the Trainer callback needs `attach(trainer)`. Callbacks are handed the unwrapped
model, and the hook must go on the DDP wrapper (`trainer.model_wrapped`), which only
the Trainer holds. attach() also makes the callback the Trainer's first, so that the
stats it adds to a log are there when the other callbacks (the reporters) see it. (It
does not call trainer.log itself: a log resets the Trainer's should_log, and the
step's loss would then go unlogged.)

The Trainer's default is `find_unused_parameters=True` for DDP, which costs a graph
traversal every step; EDGC needs every parameter's gradient at every step anyway, so
set `ddp_find_unused_parameters=False` (the callback warns otherwise).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from edgc.integrations import _register, _require, _tell_learning_rate, log_values

_require("transformers", "hf", "edgc.integrations.hf")
_require("accelerate", "hf", "edgc.integrations.hf")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DDPCommunicationHookType  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments  # noqa: E402

from edgc.checkpoint import FILE_NAME, load_states, save_states  # noqa: E402
from edgc.comm import EDGCState  # noqa: E402
from edgc.config import EDGCConfig  # noqa: E402

logger = logging.getLogger(__name__)

__all__ = ["EDGCTrainerCallback", "register_edgc"]


#: How a Trainer or Accelerate user fixes what edgc.integrations._register refuses or warns of.
_HINTS = {
    "wrapper_hint": "not DistributedDataParallel (FSDP and DeepSpeed are not supported)",
    "unused_hint": "set ddp_find_unused_parameters=False in TrainingArguments, or find_unused_parameters=False in "
                   "DistributedDataParallelKwargs",
}


# ---------------------------------------------------------------------------- Accelerate


def register_edgc(accelerator: Accelerator, model: Any, config: EDGCConfig | None = None, *,
                  process_group: dist.ProcessGroup | None = None,
                  optimizer: torch.optim.Optimizer | None = None) -> EDGCState:
    """Compress `model`'s gradient with EDGC; call it after `accelerator.prepare(model)`.

    Registers edgc_hook on the DDP wrapper `prepare` returned, and adds save/load hooks
    to `accelerator` so that `save_state(folder)` writes every replica's EDGC state to
    folder/edgc_state.pt and `load_state(folder)` gives each replica its own (call
    load_state before the first step after it). With `optimizer` (the one `prepare`
    returned, or the plain one), a forward pre-hook on the wrapper tells the state the
    optimizer's learning rate before each forward, so before the backward pass whose
    gradient the hook syncs: the largest rate among its param groups, as the scheduler
    has left it for this step (the "critical" policy raises the rank after a drop).
    Without it, call `state.set_learning_rate(lr)` before each backward yourself.
    Returns the state; send its stats to the trackers with
    `accelerator.log(log_values(state.stats()), step=step)`.
    """
    handler = accelerator.ddp_handler
    if handler is not None and handler.comm_hook != DDPCommunicationHookType.NO:
        raise ValueError(f"DistributedDataParallelKwargs(comm_hook={handler.comm_hook}) already registers a hook on "
                         "this model; drop it (register_edgc registers edgc_hook)")
    state = EDGCState(process_group, config)
    if not _register(model, state, accelerator.num_processes, "register_edgc", **_HINTS):
        return state
    if optimizer is not None:
        optimizers = [optimizer]

        def tell_learning_rate(module: Any, inputs: Any) -> None:
            # (every forward, evaluation's too: the rate read is the next step's either way)
            _tell_learning_rate(state, optimizers)

        model.register_forward_pre_hook(tell_learning_rate)

    def save(models: list[Any], weights: list[Any], folder: str) -> None:
        # (every process runs save_state's hooks: the gather is a collective)
        save_states(state, folder, step=state.step)

    def load(models: list[Any], folder: str) -> None:
        load_states(state, folder)

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)
    return state


# ---------------------------------------------------------------------------- the Trainer


class EDGCTrainerCallback(TrainerCallback):
    """Compress the DDP gradient with EDGC in a transformers Trainer.

    Give it its Trainer with `attach(trainer)`, before `trainer.train()`. At the start of
    training it registers the hook on the Trainer's DDP wrapper (and, when resuming,
    first loads this replica's state from the checkpoint folder); at each save it writes
    every replica's state to checkpoint-N/edgc_state.pt; to each training log (every
    `logging_steps`) it adds rank, entropy, phase, compression ratio and bytes sent
    (edgc.integrations.log_values), so they reach log_history, the console and every
    `report_to` integration. `self.state` is the EDGCState.

    At the start of each optimizer step (on_step_begin, once per step whatever
    `gradient_accumulation_steps`, before the first micro-batch's backward pass) it tells
    the state the learning rate of the Trainer's optimizer: the largest among its param
    groups, as the scheduler has left it for this step (set_learning_rate; the
    "critical" policy raises the rank for the window after a drop).
    """

    def __init__(self, config: EDGCConfig | None = None, *, process_group: dist.ProcessGroup | None = None,
                 log_stats: bool = True) -> None:
        self.state = EDGCState(process_group, config)
        self.log_stats = log_stats
        self._trainer: Trainer | None = None
        self._ddp: Any = None

    def attach(self, trainer: Trainer) -> EDGCTrainerCallback:
        """Keep `trainer` (for its DDP wrapper) and make this callback its first one (so
        that the stats it adds to a log reach every other callback's on_log: the
        console, TensorBoard, W&B...). Returns self."""
        self._trainer = trainer
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        callbacks.insert(0, self)
        return self

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        trainer = self._trainer
        if trainer is None:
            raise RuntimeError("EDGCTrainerCallback needs its Trainer: call callback.attach(trainer) before "
                               "trainer.train() (callbacks see only the unwrapped model, the hook goes on the "
                               "Trainer's DDP wrapper)")
        if state.global_step > 0 and self.state.step == 0:
            self._resume(args, state.global_step)
        if trainer.model_wrapped is self._ddp:
            return  # (a second train() on the same wrapper)
        _register(trainer.model_wrapped, self.state, args.world_size, "EDGCTrainerCallback", **_HINTS)
        self._ddp = trainer.model_wrapped

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        """Tell the state this step's learning rate (the Trainer steps its scheduler after
        optimizer.step(), so the optimizer holds this step's rate now)."""
        optimizer = kwargs.get("optimizer")
        if optimizer is not None:
            _tell_learning_rate(self.state, [optimizer])

    def _resume(self, args: TrainingArguments, step: int) -> None:
        """Load this replica's state from the checkpoint training resumes from: the folder
        args.resume_from_checkpoint names, or output_dir/checkpoint-STEP (where the
        Trainer saves, and where train(resume_from_checkpoint=True) looks)."""
        folders = [Path(args.resume_from_checkpoint)] if args.resume_from_checkpoint else []
        folders.append(_output_dir(args) / f"checkpoint-{step}")
        for folder in folders:
            if (folder / FILE_NAME).is_file():
                load_states(self.state, folder, step=step)
                return
        logger.warning("training resumes at step %s, and none of %s holds an EDGC state (%s): EDGC starts again "
                       "from warm-up; if the checkpoint is elsewhere, name it in "
                       "TrainingArguments(resume_from_checkpoint=...)", step, [str(f) for f in folders], FILE_NAME)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        # (the Trainer has just written checkpoint-N on rank 0; every rank gets here)
        save_states(self.state, _output_dir(args) / f"checkpoint-{state.global_step}", step=state.global_step)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        """Add the EDGC stats to each training log (the ones with "loss"), and to its
        entry in state.log_history (the Trainer appends that before calling on_log)."""
        if not self.log_stats or logs is None or "loss" not in logs or self.state.step == 0:
            return
        values = log_values(self.state.stats())
        logs.update(values)
        last = state.log_history[-1] if state.log_history else {}
        if last.get("step") == state.global_step and last.get("loss") == logs["loss"]:
            last.update(values)


def _output_dir(args: TrainingArguments) -> Path:
    """args.output_dir as a Path (TrainingArguments fills in its default: never None here)."""
    assert args.output_dir is not None
    return Path(args.output_dir)
