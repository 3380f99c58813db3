"""What the data-parallel and the pipeline trainers share: schedule, optimiser groups,
model identity for checkpoints, restoring one rank's state on resume, and the precision recipe."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from edgc.checkpoint import restore_state
from edgc.comm.activation import resized_activation_state
from edgc.comm.hook import EDGCState
from edgc.comm.replicas import replica_entry
from edgc.config import EDGCConfig
from edgc.data.stream import BatchStream
from edgc.fsdp import EDGCFSDPState
from edgc.models import build_model
from edgc.train.checkpoint import saved_tp
from edgc.train.config import TrainConfig

logger = logging.getLogger(__name__)

#: Loads a checkpoint's {"model", "optimizer"} into a module and its optimiser.
LoadWeights = Callable[[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]], None]

__all__ = ["DivergenceGuard", "Precision", "TrainingDiverged", "all_finite", "compile_blocks", "load_plain_weights",
           "lr_at", "model_config", "new_length_warning", "param_groups", "resized_accum", "restore_rank",
           "restore_resized", "restore_resized_stage", "resumed_stream", "tell_learning_rate", "window_signals"]


class TrainingDiverged(RuntimeError):
    """The loss or gradients stayed non-finite for too many steps in a row."""


def all_finite(tensors: Any) -> bool:
    """Whether every floating-point tensor in a (nested) state dict is finite."""
    if isinstance(tensors, torch.Tensor):
        return not tensors.is_floating_point() or bool(torch.isfinite(tensors).all())
    if isinstance(tensors, dict):
        return all(all_finite(v) for v in tensors.values())
    if isinstance(tensors, (list, tuple)):
        return all(all_finite(v) for v in tensors)
    return True


class DivergenceGuard:
    """Watches each step's loss and gradient norm (the same on every rank: both are
    all-reduced), so that every rank stops alike when they stay non-finite for `limit`
    steps in a row, so that no checkpoint is written from a non-finite model, and so that
    a run that reaches its end diverged, too short for `limit`, says so (`verdict`).

    A few non-finite steps in a row are normal with fp16 (the GradScaler skips them while
    it lowers its scale); `limit` of them are not. So with `loss_scaled` (a GradScaler at
    work), a run whose last steps had a finite loss and a non-finite gradient norm has not
    diverged by its end: the scaler skipped them, and the weights are those of the last
    finite step.
    """

    def __init__(self, limit: int, run_dir: str, checkpoint_step: int | None, *, loss_scaled: bool = False) -> None:
        self.limit = limit
        self.loss_scaled = loss_scaled
        self.run_dir = run_dir
        self.checkpoint_step = checkpoint_step  # the last finite checkpoint's step (None: none yet)
        self.streak = 0
        self.finite = True  # the last step's loss and gradient norm
        self.last: tuple[int, float, float] | None = None  # the last step: (step, loss, gradient norm)
        self.refused: str | None = None  # why the last checkpoint step wrote none (None: it wrote one)

    def observe(self, step: int, loss: float, grad_norm: float) -> None:
        """Record a step; raise TrainingDiverged after `limit` non-finite steps in a row."""
        self.finite = math.isfinite(loss) and math.isfinite(grad_norm)
        self.streak = 0 if self.finite else self.streak + 1
        self.last = (step, loss, grad_norm)
        if self.streak >= self.limit:
            raise TrainingDiverged(
                f"training diverged: the loss or gradient norm was not finite for {self.streak} steps in a row "
                f"(steps {step - self.streak + 1}-{step}; updates were skipped); {self._kept()}. Try a lower --lr")

    def verdict(self, val_loss: float | None) -> str | None:
        """Why the run that ended at the last step observed has diverged, or None if it has
        not: the checkpoint of its last step (every run ends with one) was refused as not
        finite, or its validation loss there (`val_loss`; None: not evaluated) is not
        finite. One line naming the step, its loss and what is kept. Call it on rank 0,
        which alone checks the checkpoints (`may_save`)."""
        if self.last is None:
            return None
        step, loss, norm = self.last
        scaler_skip = self.loss_scaled and math.isfinite(loss)
        if self.refused and not self.finite and not scaler_skip:
            what = (f"the loss or gradient norm was not finite for the last {self.streak} steps of the run "
                    f"({step - self.streak + 1}-{step}; updates were skipped)" if self.streak > 1 else
                    "the loss or gradient norm was not finite at the last step of the run (its update was skipped)")
        elif self.refused and self.finite:
            what = "the model's weights were not finite after the last step of the run"
        elif val_loss is not None and not math.isfinite(val_loss):
            what = "the validation loss was not finite at the last step of the run"
        else:
            return None
        val = f", validation loss {val_loss:.6g}" if val_loss is not None else ""
        return (f"training diverged: {what}: at step {step}, loss {loss:.6g}, gradient norm {norm:.6g}{val}; "
                f"{self._kept()}")

    def _kept(self) -> str:
        """The last finite checkpoint, in words."""
        if self.checkpoint_step is None:
            return "no checkpoint was written"
        return f"the last good checkpoint is {self.run_dir}/checkpoint.pt at step {self.checkpoint_step}"

    def may_save(self, step: int, weights: Any) -> bool:
        """Whether a checkpoint may be written now (last step finite and `weights` all
        finite); remembers the step if so, else logs a warning saying why not."""
        why = ("the loss or gradient norm of this step was not finite" if not self.finite
               else None if all_finite(weights) else "the model's weights are not finite")
        if why is None:
            self.checkpoint_step = step
            self.refused = None
            return True
        if not self.refused:  # (once per run of refusals: a diverged run would repeat it at every checkpoint step)
            kept = (f"the last good checkpoint, step {self.checkpoint_step}, is kept"
                    if self.checkpoint_step is not None else "no checkpoint was written yet")
            logger.warning("step %d: no checkpoint written, %s (%s; so for every checkpoint step until one is "
                           "finite again)", step, why, kept)
        self.refused = why
        return False


def compile_blocks(blocks: torch.nn.ModuleList) -> None:
    """Compile each block in place (`nn.Module.compile`: torch.compile with its default
    backend), before DDP or fully_shard wraps the model (TrainConfig.compile). Block by
    block, as torchtitan compiles: one graph per block, reused by every block of the same
    shape; the sync's hooks and collectives run between the blocks, outside the graphs;
    the parameters keep their names (no `_orig_mod.` prefix in a checkpoint)."""
    for block in blocks:
        block.compile()


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate at `step` (1-based): linear warm-up, then cosine decay to min_lr, or
    with lr_schedule "step" lr times lr_drop_gamma for each of lr_drop_steps reached (the
    drops apply during the warm-up too)."""
    assert cfg.lr_warmup_steps is not None and cfg.min_lr is not None
    if cfg.lr_schedule == "step":
        peak = cfg.lr * cfg.lr_drop_gamma ** sum(1 for at in cfg.lr_drops() if at <= step)
        return peak * min(1.0, step / max(1, cfg.lr_warmup_steps))
    if step <= cfg.lr_warmup_steps:
        return cfg.lr * step / max(1, cfg.lr_warmup_steps)
    progress = (step - cfg.lr_warmup_steps) / max(1, cfg.steps - cfg.lr_warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))) * (cfg.lr - cfg.min_lr)


def tell_learning_rate(hook_state: Any, lr: float) -> None:
    """Give an EDGC state the learning rate of the step about to run (its "critical" policy
    raises the rank after a drop); other hook states take none."""
    if hasattr(hook_state, "set_learning_rate"):
        hook_state.set_learning_rate(lr)


def window_signals(stats: Any) -> dict[str, Any]:
    """The window signals of a hook state's stats (EDGCStats) for a metrics.jsonl record:
    "critical_rho", "window_norm" and "lr_drop" of the "critical" policy's last window
    end (null, and false, before one and for other policies), and "noise_scale", the last
    window's gradient noise scale in units of one replica's batch (null where not measured)."""
    return {"critical_rho": stats.critical_rho, "window_norm": stats.window_norm, "lr_drop": bool(stats.lr_drop),
            "noise_scale": stats.noise_scale}


def model_config(cfg: TrainConfig, vocab_size: int) -> dict[str, Any]:
    """The model's GPTConfig as a dict, for matching checkpoints (built on meta: free)."""
    model = build_model(cfg.preset, vocab_size=vocab_size, block_size=cfg.block_size, device="meta")
    return dataclasses.asdict(model.config)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices and embeddings, none on biases and norms (GPT-2 practice)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def load_plain_weights(module: torch.nn.Module, opt: torch.optim.Optimizer, weights: dict[str, Any]) -> None:
    """Load a checkpoint's "model" and "optimizer" into a plain (unsharded) module and its optimiser."""
    module.load_state_dict(weights["model"])
    opt.load_state_dict(weights["optimizer"])


def restore_rank(ckpt: dict[str, Any], weights: dict[str, Any], module: torch.nn.Module,
                 opt: torch.optim.Optimizer, hook_state: Any, *,
                 load_weights: LoadWeights | None = None,
                 ) -> int:
    """Load `weights` ({"model", "optimizer"}) and this rank's compression state and RNG
    from a checkpoint of this job's world size; returns the step it was taken at.
    `load_weights` loads the first two where the module is not a plain one (a sharded
    model)."""
    (load_weights or load_plain_weights)(module, opt, weights)
    mine = replica_entry(ckpt["replicas"])
    hook_state.load_state_dict(mine["comm"])
    torch.set_rng_state(mine["torch_rng"])
    return int(ckpt["step"])


def restore_resized(ckpt: dict[str, Any], cfg: TrainConfig, module: torch.nn.Module, opt: torch.optim.Optimizer,
                    hook_state: Any, *, rank: int, replicas: int,
                    load_weights: LoadWeights | None = None,
                    ) -> int:
    """Load a checkpoint of another number of replicas (DDP, or HSDP with the same shards
    and TP ranks) into process `rank` of a job of `replicas` data-parallel ranks: the
    weights and optimiser state (`load_weights` for a sharded model), the compression
    state resized (edgc.checkpoint.resize_states, EDGCFSDPState.load_resized: Q and the
    policy's state from the first replica, every replica's error feedback the old ones'
    mean), and the RNG of old process rank mod the old number; sets cfg.grad_accum
    (`resized_accum`) and says on rank 0 what became of the global batch. Returns the
    step it was taken at. Raises ValueError for a method whose state cannot be resized
    (torch's PowerSGD hook keeps its error feedback per DDP bucket)."""
    (load_weights or load_plain_weights)(module, opt, ckpt)
    entries = ckpt["replicas"]
    _load_resized_comm(hook_state, [e["comm"] for e in entries], ckpt["train"]["method"])
    torch.set_rng_state(entries[rank % len(entries)]["torch_rng"])
    saved, saved_accum = len(entries) // saved_tp(ckpt), int(ckpt["train"]["grad_accum"])
    cfg.grad_accum = resized_accum(saved_accum, saved, replicas)  # (and so in the checkpoints it writes)
    if rank == 0:
        logger.warning("resumed on %d replicas from %d at step %d: %d micro-batches a step (was %d), a global batch "
                       "of %d samples (was %d)", replicas, saved, ckpt["step"], cfg.grad_accum, saved_accum,
                       cfg.batch_size * cfg.grad_accum * replicas, cfg.batch_size * saved_accum * saved)
    return int(ckpt["step"])


def restore_resized_stage(ckpt: dict[str, Any], weights: dict[str, Any], module: torch.nn.Module,
                          opt: torch.optim.Optimizer, hook_state: Any, compressor: Any, *, stage: int, replica: int,
                          tp_rank: int, tp: int, load_weights: LoadWeights | None = None) -> int:
    """A pipeline's `restore_resized`: this rank (`stage`, `replica`, `tp_rank`) of a job
    with another number of replicas per stage than its checkpoint's. The stage's `weights`,
    the compression state of the stage's old replicas at this TP rank resized (Q and the
    policy's state from the first, the error feedback's mean), the activation compressor's
    likewise (`resized_activation_state`), and the RNG of the old replica whose index is
    `replica` mod their number.
    Returns the step. (The global batch changes with the replicas: a pipeline step is one
    batch a replica.)"""
    (load_weights or load_plain_weights)(module, opt, weights)
    old = int(ckpt["layout"][1])
    entries = [ckpt["replicas"][(stage * old + j) * tp + tp_rank] for j in range(old)]
    _load_resized_comm(hook_state, [e["comm"] for e in entries], ckpt["train"]["method"])
    if compressor is not None:
        compressor.load_state_dict(resized_activation_state([e["activation"] for e in entries]))
    torch.set_rng_state(entries[replica % old]["torch_rng"])
    return int(ckpt["step"])


def _load_resized_comm(hook_state: Any, states: list[dict[str, Any]], method: str) -> None:
    """Load into `hook_state` the compression states of the old replicas it stands for
    (`states`, one each), resized to its job's replicas; raises ValueError for a method
    whose state cannot be resized."""
    if isinstance(hook_state, EDGCState):
        restore_state(hook_state, states, resize=True)
    elif isinstance(hook_state, EDGCFSDPState):
        hook_state.load_resized(states)
    elif states[0].get("format") in ("allreduce-state", "no-sync-state", "native-hsdp-state"):  # (counters only)
        hook_state.load_state_dict({**states[0], "world_size": hook_state.world_size})
    else:
        raise ValueError(f"a run of method {method!r} resumes only on the {len(states)} replicas it was saved on: "
                         "its state cannot be resized")


def resized_accum(saved_accum: int, saved_replicas: int, replicas: int) -> int:
    """Micro-batches a step for a run saved on `saved_replicas` replicas of `saved_accum`
    each and resumed on `replicas`: the same global batch where it shares out evenly
    (2 replicas of 1 on 1 replica: 2), else `saved_accum` (the global batch then grows or
    shrinks with the replicas: 2 replicas of 1 on 4 replicas: 1, twice the batch)."""
    total = saved_accum * saved_replicas
    return total // replicas if total % replicas == 0 else saved_accum


def resumed_stream(ckpt: dict[str, Any], tokens: Any, cfg: Any, *, replica_ranks: list[int], accum: int) -> BatchStream:
    """The run's batch stream where its checkpoint left it (edgc.data.stream): its "data"
    entry, or, in a checkpoint written before the stream, the generators of its replicas,
    replica j's held by the entry of rank replica_ranks[j], after `accum` micro-batches a
    step."""
    if "data" in ckpt:
        stream = BatchStream(tokens, cfg.batch_size, cfg.block_size, seed=cfg.seed,
                             sequences=len(ckpt["data"]["generators"]))
        stream.load_state_dict(ckpt["data"])
        return stream
    states = [ckpt["replicas"][r]["generator"] for r in replica_ranks]
    return BatchStream.from_replica_generators(tokens, cfg.batch_size, cfg.block_size, seed=cfg.seed, states=states,
                                               step=int(ckpt["step"]), accum=accum)


class Precision:
    """Autocast and, for fp16, a GradScaler: torch's AMP recipe for one training run."""

    def __init__(self, dtype: str, device: torch.device) -> None:
        self.dtype = dtype
        self.device_type = device.type
        self.cast = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        self.scaler = torch.amp.GradScaler(device.type, enabled=dtype == "fp16")

    def autocast(self) -> Any:
        if self.cast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.cast)

    def tell(self, hook_state: Any) -> None:
        """Give the hook the loss scale the next gradients carry (fp16 only)."""
        if self.scaler.is_enabled() and hasattr(hook_state, "set_grad_scale"):
            hook_state.set_grad_scale(self.scaler.get_scale())

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def load_state_dict(self, d: dict[str, Any] | None) -> None:
        if d:
            self.scaler.load_state_dict(d)


def new_length_warning(before: TrainConfig, after: TrainConfig, at: int) -> str:
    """What a resume from step `at` that changes the run's length from `before.steps` to
    `after.steps` does (the two configs otherwise the run's): the learning-rate schedule
    is worked out over the new length from the next step on, and what the run set from its
    first length (the learning rate's warm-up, the compression's window and warm-up) stays.
    Not the run that `after.steps` gives from the start."""
    old, new = before.resolve(), after.resolve()
    if new.lr_schedule == "cosine":
        lr = (f"the cosine learning rate is recomputed over {new.steps} steps, so step {at + 1} runs at "
              f"{lr_at(at + 1, new):.2e} where step {at} ran at {lr_at(at, old):.2e}")
    else:
        lr = f'the "step" schedule\'s drops stay at steps {new.lr_drop_steps}'
    kept = [f"the learning rate's warm-up ({new.lr_warmup_steps} steps)"]
    if new.method not in ("none", "compute-only", "diloco"):
        edgc = EDGCConfig.from_dict(new.edgc)
        kept += [f"the compression's window ({edgc.window} steps)", f"its warm-up (warmup_steps {edgc.warmup_steps})"]
    return (f"resuming with --steps {new.steps} (the run's: {old.steps}): {lr}; these stay as the {old.steps}-step "
            f"run set them: {', '.join(kept)}. This continues the run; it is not the run --steps {new.steps} gives "
            f"from the start (start a new run for that)")
