"""Worker functions for the integration tests: each trains with the real framework on
the gloo group run_local made, once straight through and once resumed from a checkpoint
saved midway, and returns what the test compares (importable by spawned processes)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from edgc import EDGCConfig

# Small enough to run in seconds, big enough that its matrices compress at rank 2: two
# warm-up steps, then compression; windows of 2 steps so the policy acts within the run.
CONFIG = dict(warmup_steps=2, window=2, max_rank=4, min_rank=2, iteration_sample_rate=1.0, warmup="fixed")

# "critical" with a threshold rho never reaches: r_max = 4 for the first compressed window
# (steps 3-4: no earlier window to compare with), then r_lo = 2, and r_max again only for
# the window after one in which the learning rate dropped. The rate falls tenfold from
# step DROP_AT (1-based), inside the window of steps 5-6: steps 7-8 run at r_max.
CRITICAL = dict(CONFIG, policy="critical", critical_threshold=1e6, critical_low_rank=2)
DROP_AT, DROP_STEPS = 6, 8


def _quiet() -> None:
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "transformers", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def shared_part(state_dict: dict[str, Any]) -> dict[str, Any]:
    """What every replica's EDGC state must agree on (error feedback is each one's own)."""
    compression = state_dict["compression"]
    shared = ("step", "phase", "applied_rank", "r_min", "r_max", "policy", "entropy", "gate")
    return {k: state_dict[k] for k in shared} | {
        "generator": compression["generator"], "uncompressed_slots": compression["uncompressed_slots"],
        "q": [g["q"] for g in compression["groups"]], "entropy_now": state_dict["stats"]["last_entropy"],
        "bytes": (state_dict["stats"]["bytes_sent"], state_dict["stats"]["bytes_uncompressed"])}


def exact_part(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Everything a resumed run must reproduce exactly: all but measured times."""
    timings = ("comm_seconds", "entropy_seconds", "compress_seconds")
    return {k: v for k, v in state_dict.items() if k != "stats"} | {
        "stats": {k: v for k, v in state_dict["stats"].items() if k not in timings}}


def _data(n: int, seed: int = 0) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return torch.utils.data.TensorDataset(x, torch.tanh(x @ torch.randn(16, 8, generator=g)))


# ---------------------------------------------------------------------------- Lightning


def _lightning_net(drop_at: int | None = None) -> Any:
    """A LightningModule: SGD at 0.2, with `drop_at` a tenth of it from that 1-based step
    on (a MultiStepLR stepped every step); `model.lrs` gets each step's rate."""
    import lightning as L

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
            self.lrs: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.2)
            if drop_at is None:
                return opt
            drop = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[drop_at - 1], gamma=0.1)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": drop, "interval": "step"}}

    return Net()


def _lightning_loader(rank: int, world: int) -> torch.utils.data.DataLoader:
    """8 samples, 4 per rank: one batch an epoch, so that a resumed run sees the same
    batches however Lightning replays data (it restarts a plain DataLoader from its first
    batch when resuming mid-epoch, and runs one extra batch after an epoch-end checkpoint)."""
    data = _data(8)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
    return torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)


def lightning_run(rank: int, world: int, out: str) -> dict[str, Any]:
    """Fit 6 steps straight (a checkpoint every 3 steps), then fit again from the step-3
    checkpoint with fresh objects; both on the same group."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from edgc.integrations.lightning import EDGCCallback

    _quiet()
    loader = _lightning_loader(rank, world)

    def fit(name: str, ckpt_path: str | None = None, seed: int = 0) -> tuple[L.LightningModule, EDGCCallback]:
        torch.manual_seed(seed)
        model = _lightning_net()
        callback = EDGCCallback(EDGCConfig.from_dict(CONFIG))
        trainer = L.Trainer(
            accelerator="cpu", devices=world, strategy="ddp", max_steps=6, log_every_n_steps=1,
            use_distributed_sampler=False,
            callbacks=[callback, ModelCheckpoint(dirpath=Path(out) / name, filename="{step}", save_top_k=-1,
                                                 every_n_train_steps=3)],
            logger=CSVLogger(out, name=name, version=0), enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=out)
        trainer.fit(model, loader, ckpt_path=ckpt_path)
        return model, callback

    straight, cb = fit("straight")
    # (a different initialisation: the weights must come from the checkpoint)
    resumed, cb_resumed = fit("resumed", ckpt_path=str(Path(out) / "straight" / "step=3.ckpt"), seed=1)
    return {"params": _flat(straight), "state": cb.state.state_dict(), "stats": cb.state.stats(),
            "resumed_params": _flat(resumed), "resumed_state": cb_resumed.state.state_dict()}


def _signal(state: Any) -> tuple[int, bool]:
    """What a step did, for the learning-rate tests: its rank and the last window end's drop."""
    stats = state.stats()
    return stats.step_rank, stats.lr_drop


def lightning_lr_drop_run(rank: int, world: int, out: str) -> dict[str, Any]:
    """Fit DROP_STEPS steps, policy "critical", a scheduler dropping the rate at DROP_AT;
    returns the parameters, each step's rate and each step's _signal."""
    import lightning as L

    from edgc.integrations.lightning import EDGCCallback

    _quiet()
    signals: list[tuple[int, bool]] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            signals.append(_signal(edgc.state))

    torch.manual_seed(0)
    model = _lightning_net(drop_at=DROP_AT)
    edgc = EDGCCallback(EDGCConfig.from_dict(CRITICAL), log_stats=False)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp", max_steps=DROP_STEPS,
                        use_distributed_sampler=False, callbacks=[edgc, Record()], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=out)
    trainer.fit(model, _lightning_loader(rank, world))
    return {"params": _flat(model), "lrs": model.lrs, "signals": signals, "stats": edgc.state.stats()}


# ---------------------------------------------------------------------------- Hugging Face


class _Tokens(torch.utils.data.Dataset):
    """Random token blocks, each its own label (the model shifts them)."""

    def __init__(self, n: int, block: int = 16, vocab: int = 64) -> None:
        self.ids = torch.randint(0, vocab, (n, block), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _tiny_gpt2():
    """A one-block GPT-2 built from a config (nothing downloads), without dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def trainer_run(rank: int, world: int, out: str) -> dict[str, Any]:
    """Train 6 steps straight (checkpoints every 3 steps), then resume from checkpoint-3
    with fresh objects into the same output folder."""
    from transformers import Trainer, TrainingArguments

    from edgc.integrations.hf import EDGCTrainerCallback

    _quiet()
    # 24 blocks, 12 per rank, 2 per batch: 6 steps, one epoch, so the resume is mid-epoch
    data = _Tokens(24)

    def train(resume: str | None = None, seed: int = 0) -> tuple[Any, EDGCTrainerCallback, Any]:
        torch.manual_seed(seed)
        model = _tiny_gpt2()
        args = TrainingArguments(
            output_dir=out, max_steps=6, save_steps=3, per_device_train_batch_size=2, learning_rate=1e-2,
            logging_steps=1, report_to="none", use_cpu=True, ddp_find_unused_parameters=False, seed=0,
            disable_tqdm=True, dataloader_num_workers=0)
        trainer = Trainer(model=model, args=args, train_dataset=data)
        callback = EDGCTrainerCallback(EDGCConfig.from_dict(CONFIG)).attach(trainer)
        trainer.train(resume_from_checkpoint=resume)
        return model, callback, trainer

    straight, cb, trainer = train()
    logged = [r for r in trainer.state.log_history if "edgc/compression_ratio" in r]
    result = {"params": _flat(straight), "state": cb.state.state_dict(), "stats": cb.state.stats(), "logged": logged}
    resumed, cb_resumed, _ = train(resume=str(Path(out) / "checkpoint-3"), seed=1)
    return result | {"resumed_params": _flat(resumed), "resumed_state": cb_resumed.state.state_dict()}


def trainer_lr_drop_run(rank: int, world: int, out: str) -> dict[str, Any]:
    """DROP_STEPS optimizer steps of 2 micro-batches each (gradient accumulation), policy
    "critical", `optimizers=(opt, scheduler)` dropping the rate at DROP_AT; returns the
    parameters, each step's rate and each step's _signal."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from edgc.integrations.hf import EDGCTrainerCallback

    _quiet()
    lrs: list[float] = []
    signals: list[tuple[int, bool]] = []

    class Record(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            lrs.append(kwargs["optimizer"].param_groups[0]["lr"])

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            signals.append(_signal(edgc.state))

    torch.manual_seed(0)
    model = _tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    drop = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[DROP_AT - 1], gamma=0.1)
    args = TrainingArguments(
        output_dir=out, max_steps=DROP_STEPS, per_device_train_batch_size=1, gradient_accumulation_steps=2,
        save_strategy="no", report_to="none", use_cpu=True, ddp_find_unused_parameters=False, seed=0,
        disable_tqdm=True, dataloader_num_workers=0)
    # 32 blocks, 16 per rank, 2 micro-batches of 1 per step: DROP_STEPS steps in one epoch
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens(4 * DROP_STEPS), optimizers=(opt, drop),
                      callbacks=[Record()])
    edgc = EDGCTrainerCallback(EDGCConfig.from_dict(CRITICAL), log_stats=False).attach(trainer)
    trainer.train()
    return {"params": _flat(model), "lrs": lrs, "signals": signals, "stats": edgc.state.stats()}


def accelerate_run(rank: int, world: int, out: str) -> dict[str, Any]:
    """A hand-written loop under an Accelerator: 6 steps straight with save_state after
    step 3, then fresh objects, load_state, and steps 4 to 6 again."""
    from accelerate import Accelerator

    from edgc.integrations import log_values
    from edgc.integrations.hf import register_edgc

    _quiet()
    data = _data(8 * world)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = (step % 2) * 4 * world + 4 * rank  # (two batches per replica, alternating)
        return data.tensors[0][i : i + 4], data.tensors[1][i : i + 4]

    def run(start: int, seed: int, load: bool) -> tuple[nn.Module, Any, list[dict[str, float]]]:
        accelerator = Accelerator(cpu=True)
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
        opt = torch.optim.SGD(model.parameters(), lr=0.2)
        model, opt = accelerator.prepare(model, opt)
        state = register_edgc(accelerator, model, EDGCConfig.from_dict(CONFIG))
        if load:
            accelerator.load_state(str(Path(out) / "step-3"))
        logged = []
        for step in range(start, 6):
            x, y = batch(step)
            loss = F.mse_loss(model(x), y)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            logged.append(log_values(state.stats()))
            if step == 2 and not load:
                accelerator.save_state(str(Path(out) / "step-3"))
        return accelerator.unwrap_model(model), state, logged

    straight, state, logged = run(0, seed=0, load=False)
    resumed, resumed_state, _ = run(3, seed=1, load=True)
    return {"params": _flat(straight), "state": state.state_dict(), "stats": state.stats(), "logged": logged,
            "resumed_params": _flat(resumed), "resumed_state": resumed_state.state_dict()}


def accelerate_lr_drop_run(rank: int, world: int, out: str) -> dict[str, Any]:
    """DROP_STEPS steps of a hand-written loop, policy "critical", register_edgc given the
    optimizer, a prepared scheduler dropping the rate at DROP_AT; returns the parameters,
    each step's rate and each step's _signal."""
    from accelerate import Accelerator

    from edgc.integrations.hf import register_edgc

    _quiet()
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    # (a prepared scheduler steps once per process at each step: Accelerate scales it to
    # the world's batch, so the milestone counts world steps per step)
    drop = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[(DROP_AT - 1) * world], gamma=0.1)
    model, opt, drop = accelerator.prepare(model, opt, drop)
    state = register_edgc(accelerator, model, EDGCConfig.from_dict(CRITICAL), optimizer=opt)
    data = _data(4 * world * DROP_STEPS)
    lrs, signals = [], []
    for step in range(DROP_STEPS):
        i = (step * world + rank) * 4
        loss = F.mse_loss(model(data.tensors[0][i : i + 4]), data.tensors[1][i : i + 4])
        accelerator.backward(loss)
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        drop.step()
        opt.zero_grad()
        signals.append(_signal(state))
    return {"params": _flat(accelerator.unwrap_model(model)), "lrs": lrs, "signals": signals,
            "stats": state.stats()}
