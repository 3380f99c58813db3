"""The training loop: GPT-2 under DDP with a chosen gradient-sync method.

Two ways in:
- `train(cfg)`: the embedded default; prepares data, then starts `cfg.workers()` local
  workers (edgc.train.launch: gloo, or NCCL with a GPU per worker) and writes the summary
  and plots when they finish.
- `train_distributed(cfg)`: under torchrun; joins the job it is given (NCCL on CUDA,
  gloo on the CPU).

Mixed precision (`dtype`) is torch's AMP recipe: the forward pass under autocast, float32
parameters and gradients, and for fp16 a GradScaler whose scale the EDGC state is told
(`EDGCState.set_grad_scale`) so its error feedback and entropy stay unscaled.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from edgc.comm.replicas import blobs_as_tensors, gather_replicas
from edgc.config import EDGCConfig, flat_sections, upgrade_config_v1, with_added_fields
from edgc.data import BatchStream, TokenFile, ensure_builtin, write_meta
from edgc.fields import table_fields
from edgc.models import build_model
from edgc.train.checkpoint import (
    CHECKPOINT_NAME,
    check_compatible,
    load_checkpoint,
    save_checkpoint,
    saved_tp,
)
from edgc.train.common import (
    DivergenceGuard,
    Precision,
    TrainingDiverged,
    compile_blocks,
    lr_at,
    model_config,
    new_length_warning,
    param_groups,
    resized_accum,
    restore_rank,
    restore_resized,
    resumed_stream,
    tell_learning_rate,
    window_signals,
)
from edgc.train.config import DILOCO_METHODS, TrainConfig, process_group_backend
from edgc.train.emulate import emulate_device_time
from edgc.train.evaluation import EvalResult, LossMoments, block_losses, eval_batches, eval_starts, write_evaluation
from edgc.train.experts import expert_digests, expert_record, expert_stats
from edgc.train.launch import WorkerError, die_with_parent, end_process_group, report_step, run_local
from edgc.train.metrics import MetricsWriter
from edgc.train.parallel import DataParallel, DiLoCoRun, clip_grads, data_parallel, replica_bytes
from edgc.train.progress import ProgressDisplay
from edgc.train.runfolder import RunLock, check_new_run, clean_leftovers
from edgc.train.summary import write_summary

logger = logging.getLogger(__name__)

__all__ = ["RESUME_MAY_CHANGE", "RunDiverged", "TrainingFailed", "lr_at", "prepare_run", "resume_config",
           "resume_target", "train", "train_distributed", "train_worker", "write_meta"]


def ensure_data(cfg: TrainConfig) -> Path:
    """The prepared data folder; tokenises the built-in corpus into the cache if needed."""
    if cfg.data is not None:
        return Path(cfg.data)
    return ensure_builtin(cfg.builtin_data_folder(), cfg.tokenizer, cfg.corpus_bytes, cfg.vocab_size)


def prepare_run(cfg: TrainConfig, resume: str | Path | None, world_size: int, overwrite: bool = False) -> TrainConfig:
    """Validate everything before any worker starts; returns the resolved config.

    `resume` is the checkpoint to continue from (None: a new run). A new run refuses a
    folder that holds another run's files unless `overwrite`; a resumed run must match
    its checkpoint's world size (or change only its number of replicas: check_compatible),
    model and method. Call it holding the folder's RunLock.
    """
    cfg.validate()
    cfg.check_layout(world_size)
    cfg = cfg.resolve()
    out = Path(cfg.out)
    if resume:
        ckpt = load_checkpoint(resume, trust=cfg.trust_checkpoint)
        data = ensure_data(cfg)
        vocab = json.loads((data / "meta.json").read_text())["vocab_size"]
        check_compatible(ckpt, world_size=world_size, preset=cfg.preset, method=cfg.method,
                         model_config=model_config(cfg, vocab),
                         layout=cfg.pipeline_layout(world_size) if cfg.pp > 1 else (1, world_size),
                         hsdp=cfg.hsdp_layout(world_size) if cfg.hsdp else None)
        if ckpt["world_size"] != world_size and cfg.pp == 1:  # (another number of replicas: as restore_resized)
            cfg = dataclasses.replace(cfg, grad_accum=resized_accum(
                int(ckpt["train"]["grad_accum"]), int(ckpt["world_size"]) // saved_tp(ckpt), world_size // cfg.tp))
        end = min(cfg.steps, cfg.stop_after or cfg.steps)
        if ckpt["step"] >= end:
            if cfg.stop_after and ckpt["step"] >= cfg.stop_after and cfg.stop_after < cfg.steps:
                how = f"--stop-after null (or a later step than {cfg.stop_after})"
            else:
                how = f"a larger --steps than {cfg.steps}"
            raise ValueError(f"checkpoint is at step {ckpt['step']}, and this run ends at step {end} "
                             f"(--steps {cfg.steps}, --stop-after {cfg.stop_after}): nothing to resume; "
                             f"continue it with: edgc train --resume {out} {how}")
    else:
        check_new_run(out, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**cfg.to_dict(), "world_size": world_size}, indent=2) + "\n")
    return cfg


# options a resumed run may change (TrainConfig fields, and "edgc.FIELD" for an EDGCConfig
# field); every other one must match its checkpoint's. edgc.min_unit_mb and edgc.max_units
# change only how the gradient is cut into units, so only the float order of the sums; compile, device and
# emulated_device_ms change how the same maths runs; nproc, dp and dp_replicate, the number of replicas
# (edgc.train.common.restore_resized).
RESUME_MAY_CHANGE = ("steps", "stop_after", "eval_every", "eval_tokens", "checkpoint_every", "keep_checkpoints",
                     "max_restarts", "max_nonfinite_steps", "progress", "log", "data", "data_cache", "device", "nproc",
                     "dp", "dp_replicate", "emulated_device_ms", "compile", "trust_checkpoint", "edgc.min_unit_mb",
                     "edgc.max_units")


def resume_target(path: str | Path) -> Path:
    """The checkpoint file to resume: `path` itself when it is a file or has a suffix, else a
    run folder's checkpoint.pt."""
    path = Path(path)
    return path / CHECKPOINT_NAME if path.is_dir() or not (path.suffix or path.is_file()) else path


def resume_config(checkpoint: str | Path, given: dict[str, Any]) -> TrainConfig:
    """The settings to continue a run with: those its checkpoint was made with, plus the
    `given` options (TrainConfig fields, "edgc" and "dac" dicts) that RESUME_MAY_CHANGE
    lists. Any other given option that differs is refused with a ValueError naming it;
    changed ones are logged. Raises RunFolderBusy when a live run holds the checkpoint's
    folder, with or without a checkpoint yet."""
    checkpoint = Path(checkpoint)
    # (before the checkpoint is read: a live run that has not reached its first checkpoint
    # step has none, and "no checkpoint" would hide that it is running)
    RunLock.check_free(checkpoint.parent)
    ckpt = load_checkpoint(checkpoint, trust=given.get("trust_checkpoint") is True)
    saved = dict(ckpt["train"])
    saved.pop("eval_batches", None)  # (runs made before eval_tokens replaced it)
    saved["trust_checkpoint"] = False  # (never kept: each resume that trusts its file says so)
    tables = table_fields(TrainConfig)
    values = {**saved, **{name: dict(saved.get(name, {})) for name in tables}}
    if values["edgc"]:  # (compared flat, as the command line gives them; a run of edgc 0.1 upgraded)
        edgc = with_added_fields(values["edgc"]) if "warmup" in values["edgc"] else upgrade_config_v1(values["edgc"])
        values["edgc"] = EDGCConfig.from_dict(edgc).to_flat()
    if values["expert_edgc"]:  # (written out whole, as `edgc`, since experts have their own)
        values["expert_edgc"] = EDGCConfig.from_dict(with_added_fields(values["expert_edgc"])).to_flat()
    given = {**given, **{k: flat_sections(given[k]) for k in ("edgc", "expert_edgc") if k in given}}
    refused: list[str] = []
    changed: list[str] = []

    def compare(name: str, table: dict[str, Any], field: str, value: Any) -> None:
        """A given option that differs from the run's: into `table` if RESUME_MAY_CHANGE
        lists its `name`, else refused."""
        if table.get(field) == value:
            return
        flag = f"--{name.replace('.', '-').replace('_', '-')} {value} (the run's: {table.get(field)})"
        (changed if name in RESUME_MAY_CHANGE else refused).append(flag)
        if name in RESUME_MAY_CHANGE:
            table[field] = value

    for key, value in given.items():
        if key in tables:
            for k, v in value.items():
                compare(f"{key}.{k}", values[key], k, v)
        elif key == "out":
            if Path(value).resolve() != checkpoint.parent.resolve():
                refused.append(f"--out {value} (the run's folder: {checkpoint.parent})")
        else:
            compare(key, values, key, value)
    if refused:
        raise ValueError(f"a resumed run keeps the settings of its checkpoint, and these differ: {'; '.join(refused)}. "
                         f"On resume only these may change: {', '.join(RESUME_MAY_CHANGE)}; start a new run "
                         f"(another --out) to change the others")
    if changed:
        logger.warning("resuming %s with changed options: %s", checkpoint.parent, "; ".join(changed))
    values["out"] = str(checkpoint.parent)
    cfg = TrainConfig.from_dict(values)
    if cfg.steps != saved["steps"] and cfg.steps >= 1:  # (a --steps below 1 is left to validate to refuse)
        logger.warning("%s", new_length_warning(dataclasses.replace(cfg, steps=saved["steps"]), cfg, ckpt["step"]))
    return cfg


def train(cfg: TrainConfig, resume: str | Path | bool | None = None, overwrite: bool = False) -> Path:
    """Train on `cfg.workers()` local workers; returns the run folder.

    `resume`: a checkpoint file, or True for the run folder's checkpoint.pt. The folder is
    locked for the whole run. When a worker dies, the job restarts from the last
    checkpoint up to `cfg.max_restarts` times; otherwise, or once they are spent, it
    raises TrainingFailed with one line (which worker, how, at which step, how to resume);
    the workers' tracebacks go to errors.log in the run folder. A run that diverges,
    stopped by `cfg.max_nonfinite_steps` or ending with its last step or validation loss
    not finite (DivergenceGuard.verdict), raises RunDiverged once its summary is written.
    """
    cfg.validate()  # (before the lock creates the folder)
    workers = cfg.workers()
    if cfg.pp > 1 and cfg.resolved_device() == "cuda" and cfg.backend(workers) != "nccl":
        raise ValueError(f"pp > 1 on CUDA needs a GPU per worker (NCCL): {workers} workers, "
                         f"{torch.cuda.device_count()} GPUs")
    cfg.check_layout(workers)
    out = Path(cfg.out)
    RunLock.check_free(out)  # (these two refuse without touching the folder; again under the lock)
    if not resume and not overwrite:
        check_new_run(out, overwrite=False)
    ckpt = (out / CHECKPOINT_NAME) if resume is True else (resume or None)
    with RunLock(out) as lock:
        for leftover in clean_leftovers(out):
            logger.warning("removed %s, left by a process killed while writing it", leftover)
        cfg = prepare_run(cfg, ckpt, workers, overwrite)
        data = ensure_data(cfg)
        restarts = 0
        while True:
            try:
                results = run_local(train_worker, workers, cfg.to_dict(), str(data), str(ckpt) if ckpt else None,
                                    backend=cfg.backend(workers), log_path=out / "errors.log", on_start=lock.note)
                break
            except WorkerError as exc:
                saved = _checkpoint_step(out, trust=cfg.trust_checkpoint)
                if exc.cause == "TrainingDiverged":  # (stopped by --max-nonfinite-steps)
                    write_summary(out)
                    raise RunDiverged(_failure_line(exc, out, saved), out) from None
                if exc.cause in _NOT_RESTARTED or exc.how == "timeout" or restarts >= cfg.max_restarts:
                    raise TrainingFailed(_failure_line(exc, out, saved)) from None
                restarts += 1
                logger.warning("%s; restarting from %s (restart %d of %d)", exc,
                               f"the checkpoint at step {saved}" if saved is not None else "the start",
                               restarts, cfg.max_restarts)
                # (from the start, the metrics writer starts metrics.jsonl afresh)
                ckpt = out / CHECKPOINT_NAME if saved is not None else None
                clean_leftovers(out)
        write_summary(out)
        if results[0]["diverged"]:  # (rank 0's verdict: it alone checks the checkpoints)
            raise _run_diverged(results[0]["diverged"], out)
    return out


# failures a restart cannot mend: the run's own settings or data, or its divergence
_NOT_RESTARTED = ("TrainingDiverged", "ValueError", "FileNotFoundError", "KeyError", "TypeError", "AssertionError")


class TrainingFailed(RuntimeError):
    """A training job failed; the message is one line, the tracebacks are in errors.log."""


class RunDiverged(TrainingFailed):
    """A run diverged: stopped by --max-nonfinite-steps, or it reached its end with a
    non-finite last step or validation loss. What it wrote is kept: its metrics, the
    summary and plots of its steps (in `run`, the run folder), and the last finite
    checkpoint if any."""

    def __init__(self, message: str, run: Path) -> None:
        super().__init__(message)
        self.run = run


def _run_diverged(verdict: str, out: Path) -> RunDiverged:
    """The error of a run that reached its end diverged (DivergenceGuard.verdict)."""
    return RunDiverged(f"{verdict}; kept: its metrics and {out / 'summary.md'}. Try a lower --lr", out)


def _checkpoint_step(run_dir: Path, trust: bool = False) -> int | None:
    """The step of the run folder's checkpoint.pt, or None if it has none (or it cannot be
    read; `trust`: as load_checkpoint's)."""
    path = run_dir / CHECKPOINT_NAME
    if not path.is_file():
        return None
    try:
        return int(load_checkpoint(path, trust=trust)["step"])
    except ValueError:
        return None


def _failure_line(exc: WorkerError, out: Path, saved: int | None) -> str:
    if exc.cause == "TrainingDiverged":
        return f"{exc} (worker tracebacks: {out / 'errors.log'})"
    resume = (f"resume from its checkpoint (step {saved}) with: edgc train --resume {out}" if saved is not None
              else "no checkpoint was written yet")
    return f"{exc}; {resume} (worker tracebacks: {out / 'errors.log'})"


def train_distributed(cfg: TrainConfig, resume: str | Path | bool | None = None, overwrite: bool = False) -> Path:
    """Train inside a torchrun job (RANK, WORLD_SIZE, MASTER_ADDR set by torchrun).

    Rank 0 holds the run folder's lock. Every worker dies with the torchrun agent that
    started it, however the agent ends. A run that diverges raises RunDiverged on rank 0,
    once its summary is written, as `train` does.
    """
    die_with_parent()
    # (without a visible GPU, validation below says why --device cuda cannot run)
    device = worker_device(cfg.resolved_device()) if torch.cuda.is_available() else torch.device("cpu")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    # torchrun's store outlives a restart, and a restarted gloo group was seen to read the
    # dead attempt's addresses from it ("Gloo connectFullMesh failed", torch 2.13): key this
    # attempt's group by torchrun's restart count
    store, rank, world = next(dist.rendezvous("env://"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(process_group_backend(device.type, local_world, torch.cuda.device_count()),
                            store=dist.PrefixStore(f"edgc/attempt-{attempt}", store), rank=rank, world_size=world)
    cfg = dataclasses.replace(cfg, nproc=world)  # torchrun decides the world, not --nproc
    ckpt = (Path(cfg.out) / CHECKPOINT_NAME) if resume is True else (resume or None)
    lock = RunLock(cfg.out)
    try:
        # rank 0 locks the folder, validates and writes config.json; one process per machine
        # tokenises the built-in corpus if its cache lacks it; everyone else waits for both
        if rank == 0:
            cfg.validate()
            lock.acquire()
            clean_leftovers(cfg.out)
            cfg = prepare_run(cfg, ckpt, world, overwrite)
        else:
            cfg.validate()
            cfg = cfg.resolve()
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            ensure_data(cfg)
        dist.barrier()
        data = ensure_data(cfg)
        stopped, verdict = None, None
        try:
            verdict = train_worker(rank, world, cfg.to_dict(), str(data), str(ckpt) if ckpt else None)["diverged"]
        except TrainingDiverged as exc:  # (every rank alike, at the same step: the guard sees all-reduced values)
            stopped = exc
        if rank == 0:
            write_summary(Path(cfg.out))
        dist.barrier()  # every rank leaves together
    finally:
        lock.release()
        # Keep this: under torchrun a gloo group still alive at interpreter shutdown can
        # abort the worker after training finished, and torchrun then reports the job
        # failed (end_process_group; docs/integrations.md, "At exit").
        end_process_group()
    # rank 0 says it and fails the job; the others leave quietly (their guards do not
    # follow the checkpoints: "no checkpoint was written" would be theirs to say)
    if stopped is not None and rank == 0:  # (by --max-nonfinite-steps)
        raise RunDiverged(str(stopped), Path(cfg.out)) from None
    if verdict:  # (rank 0's alone)
        raise _run_diverged(verdict, Path(cfg.out))
    return Path(cfg.out)


@torch.no_grad()
def evaluate(model: torch.nn.Module, val: TokenFile, cfg: TrainConfig, rank: int, world: int,
             device: torch.device, *, lockstep: bool = False, count: bool = True) -> EvalResult:
    """Validation loss and its standard error over the fixed evaluation blocks (see
    edgc.train.evaluation), block i on replica i mod `world` (`rank` is this worker's
    replica). Every worker must call it; it returns the same result on all. The model is
    left in training mode. `lockstep`: a sharded model, whose forward passes are
    collectives, so every rank runs as many as the busiest one (the extra ones, on its
    first block, are not counted). `count` False: run the forward passes but count none
    (a TP rank other than its replica's first, which computes the same losses)."""
    assert cfg.block_size is not None  # (resolved: TrainConfig.resolve filled it in)
    model.eval()
    every = eval_starts(len(val), cfg.block_size, cfg.eval_tokens)
    moments = LossMoments(device, starts=every)
    mine = np.arange(len(every))[rank::world]  # (this replica's block numbers)
    batches = 0
    for batch in eval_batches(val, every[mine], cfg.block_size, cfg.batch_size, device):
        logits, _ = model(batch.x)  # (B, T, V)
        if count:
            first = batches * cfg.batch_size
            moments.add(block_losses(logits, batch.y)[: batch.valid], mine[first : first + batch.valid])
        batches += 1
    if lockstep:
        most = -(-len(every[0::world]) // cfg.batch_size)  # (rank 0 holds the most blocks)
        if most > batches:
            spare = next(eval_batches(val, every[:1], cfg.block_size, cfg.batch_size, device)).x
            for _ in range(most - batches):
                model(spare)
    model.train()
    return moments.result(cfg.block_size)


def worker_device(device: str) -> torch.device:
    """This worker's device for a resolved `device` ("cpu" or "cuda"): its GPU (LOCAL_RANK,
    shared round-robin when there are more workers than GPUs) or the CPU. Sets it as the
    current CUDA device."""
    if device != "cuda":
        return torch.device("cpu")
    gpu = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(gpu)
    return gpu


def train_worker(rank: int, world: int, cfg_dict: dict[str, Any], data_dir: str, resume: str | None) -> dict[str, Any]:
    """One replica's training loop from the start, or from the checkpoint file `resume`.
    Rank 0 writes metrics and checkpoints. Returns {"skipped", "stats", "diverged"} (and
    with experts edgc.train.experts.expert_digests'):
    "diverged" is rank 0's DivergenceGuard.verdict on how the run ended (None: finite, and
    None on the other ranks); raises TrainingDiverged when --max-nonfinite-steps stops it."""
    cfg = TrainConfig.from_dict(cfg_dict)
    device = worker_device(cfg.device)
    use_cuda = device.type == "cuda"
    if cfg.pp > 1:
        from edgc.train.pipeline import (
            train_pipeline_worker,  # (it imports this module)
        )

        return train_pipeline_worker(rank, world, cfg_dict, data_dir, resume)
    # (resolved: TrainConfig.resolve filled these in)
    assert cfg.block_size is not None and cfg.eval_every is not None and cfg.checkpoint_every is not None
    data = Path(data_dir)
    meta = json.loads((data / "meta.json").read_text())
    train_tokens, val_tokens = TokenFile(data / "train.bin"), TokenFile(data / "val.bin")

    torch.manual_seed(cfg.seed)
    model = build_model(cfg.preset, vocab_size=meta["vocab_size"], block_size=cfg.block_size).to(device)
    if cfg.compile:
        compile_blocks(model.h)
    emulate_device_time(model.h, cfg.emulated_device_ms)
    run = data_parallel(cfg, model, device, world)
    precision = Precision(cfg.dtype, device)
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95), fused=use_cuda or None)
    if cfg.method in DILOCO_METHODS:  # (the DDP wrapper syncs nothing; DiLoCo syncs every H steps)
        run.state = DiLoCoRun(cfg, model, opt)
    hook_state = run.state
    # this replica's batches: the same on every TP rank of a replica (TP is innermost)
    replicas, replica = world // run.tp, rank // run.tp
    stream = BatchStream(train_tokens, cfg.batch_size, cfg.block_size, seed=cfg.seed, sequences=replicas)

    start = 0
    if resume:
        ckpt = load_checkpoint(resume, trust=cfg.trust_checkpoint)
        check_compatible(ckpt, world_size=world, preset=cfg.preset, method=cfg.method,
                         model_config=model_config(cfg, meta["vocab_size"]), layout=(1, world), hsdp=run.hsdp)
        stream = resumed_stream(ckpt, train_tokens, cfg, accum=int(ckpt["train"]["grad_accum"]),
                                replica_ranks=list(range(0, int(ckpt["world_size"]), saved_tp(ckpt))))
        if int(ckpt["world_size"]) == world:
            start = restore_rank(ckpt, ckpt, model, opt, hook_state, load_weights=run.load_weights)
        else:  # (another number of replicas: check_compatible refuses what cannot be resized)
            start = restore_resized(ckpt, cfg, model, opt, hook_state, rank=rank, replicas=replicas,
                                    load_weights=run.load_weights)
        precision.load_state_dict(ckpt.get("scaler"))
        del ckpt
    precision.tell(hook_state)

    writer = MetricsWriter.for_run(cfg, resume_step=start if resume else None) if rank == 0 else None
    display = ProgressDisplay(cfg.steps, start, enabled=cfg.progress and rank == 0)
    tokens_per_step = cfg.batch_size * cfg.block_size * cfg.grad_accum * replicas
    prev = hook_state.stats()
    prev_experts = expert_stats(hook_state)
    moe = model.config.n_expert > 0
    skipped = 0
    guard = DivergenceGuard(cfg.max_nonfinite_steps, cfg.out, start if resume else None,
                            loss_scaled=precision.scaler.is_enabled())
    loss_sum = torch.zeros(1, dtype=torch.float64, device=device)
    val = None
    try:
        last = min(cfg.steps, cfg.stop_after or cfg.steps)
        for step in range(start + 1, last + 1):
            report_step(step)
            lr = lr_at(step, cfg)
            for group in opt.param_groups:
                group["lr"] = lr
            tell_learning_rate(hook_state, lr)
            t0 = time.perf_counter()
            loss_sum.zero_()
            if run.dispatch is not None:
                run.dispatch.reset()  # (the evaluation's all-to-alls are not the step's)
            for micro, (x, y) in enumerate(stream.step(replicas, cfg.grad_accum, replica, device)):
                with run.sync(micro == cfg.grad_accum - 1):
                    with precision.autocast():
                        _, loss = run.module(x, y)
                    precision.scaler.scale(loss / cfg.grad_accum).backward()
                loss_sum += loss.detach().double() / cfg.grad_accum
            precision.scaler.unscale_(opt)  # (a no-op without fp16)
            norm = clip_grads(model, cfg.grad_clip if cfg.grad_clip > 0 else math.inf, tp=run.tp, experts=run.experts)
            if torch.isfinite(norm):
                precision.scaler.step(opt)
            else:  # the hook passed inf/nan through; skip the update on every replica alike
                skipped += 1
            precision.scaler.update()  # (fp16: a smaller scale after inf/nan)
            precision.tell(hook_state)
            opt.zero_grad(set_to_none=True)
            if isinstance(hook_state, DiLoCoRun):
                hook_state.step()  # (every H-th step: the outer step, a collective)
            if use_cuda:
                torch.cuda.synchronize()
            step_time = time.perf_counter() - t0

            # collective (metrics only): all-reduce SUM of the step's loss, 8 bytes
            dist.all_reduce(loss_sum)
            stats = hook_state.stats()
            sent, whole = replica_bytes(run, stats.bytes_sent - prev.bytes_sent,
                                        stats.bytes_uncompressed - prev.bytes_uncompressed)
            experts: dict[str, Any] = {}
            if moe:
                experts, prev_experts = expert_record(model, hook_state, prev_experts, run.dispatch, world, device)
                if "expert_bytes" in experts:
                    experts["dense_bytes"] = sent
                    sent += experts["expert_bytes"]
                    whole += experts.pop("expert_bytes_uncompressed")
            record = {
                "step": step, "kind": "train", "loss": float(loss_sum) / world, "lr": lr,
                "tokens_per_s": tokens_per_step / step_time, "step_time": step_time,
                "comm_time": stats.comm_seconds - prev.comm_seconds,
                "compress_time": stats.compress_seconds - prev.compress_seconds,
                "entropy_time": stats.entropy_seconds - prev.entropy_seconds,
                "bytes_sent": sent, "bytes_uncompressed": whole,
                "rank": stats.step_rank, "entropy": stats.entropy, "phase": stats.step_phase,
                "grad_norm": float(norm), "skipped": skipped, **window_signals(stats), **experts,
            }
            prev = stats
            val = None
            if step % cfg.eval_every == 0 or step == cfg.steps:
                with precision.autocast():
                    val = evaluate(model, val_tokens, cfg, replica, replicas, device, lockstep=run.hsdp is not None,
                                   count=run.tp_rank == 0)
            if writer is not None:
                writer.write(record)
                if val is not None:
                    write_evaluation(writer, step, val, folder=cfg.out)
            display.update(step, record, stats, val.loss if val is not None else None)
            guard.observe(step, record["loss"], record["grad_norm"])
            if step % cfg.checkpoint_every == 0 or step == last:
                _checkpoint(cfg, step, world, rank, model, opt, run, stream, meta, precision, guard)
            if step == cfg.steps and writer is not None:  # (the run's end, not a --stop-after)
                writer.write(memory_record(step, model, opt, hook_state, device))
    finally:
        display.close()
        if writer is not None:
            writer.close()
    return {"skipped": skipped, "stats": hook_state.stats(),
            "diverged": guard.verdict(val.loss if val is not None else None) if rank == 0 else None,
            **(expert_digests(model) if moe else {})}


def memory_record(step: int, model: torch.nn.Module, opt: torch.optim.Optimizer, hook_state: Any,
                  device: torch.device) -> dict[str, Any]:
    """This worker's memory at the end of a run, for metrics.jsonl ("kind": "memory"):
    "state_mb", the bytes it holds of the parameters, the optimiser state and the
    compression state, each as stored here (a sharded model's local shards);
    "compression_mb", the compression state's part (EDGCStats.state_bytes: its error
    feedback, Q and the window's sums, the experts' core's too); "peak_mb",
    the peak CUDA memory allocated, or on the CPU the process's peak resident set."""
    def local(t: Any) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    held = sum(local(p) for p in model.parameters())
    held += sum(local(v) for state in opt.state.values() for v in state.values())
    compression = int(getattr(hook_state.stats(), "state_bytes", 0))  # (EDGCStats.state_bytes; 0 for the others)
    experts = expert_stats(hook_state)
    compression += int(getattr(experts, "state_bytes", 0)) if experts is not None else 0
    held += compression
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (Linux: KiB)
    return {"step": step, "kind": "memory", "state_mb": held / 1e6, "compression_mb": compression / 1e6,
            "peak_mb": peak / 1e6}


def _checkpoint(cfg, step, world, rank, model, opt, run: DataParallel, stream: BatchStream, meta, precision,
                guard) -> None:
    """Gather every replica's compression state to rank 0, which writes atomically, unless
    the model is not finite (the last good checkpoint is kept)."""
    mine = {"comm": run.state.state_dict(), "torch_rng": torch.get_rng_state()}
    # (every replica's state, error feedback, Q and RNG, to rank 0: edgc.comm.replicas)
    gathered = gather_replicas(mine, dst=0)
    weights, opt_state = run.weights(model, opt)  # (under HSDP a collective: full states on rank 0)
    if rank == 0 and guard.may_save(step, weights):  # (else it says why not)
        extra = {"hsdp": list(run.hsdp)} if run.hsdp is not None else {}  # ([replicate, shard(, tp)])
        save_checkpoint(Path(cfg.out) / CHECKPOINT_NAME, {
            "step": step, "world_size": world, "train": cfg.to_dict(),
            "model_config": model_config(cfg, meta["vocab_size"]),
            "model": weights, "optimizer": opt_state, "replicas": blobs_as_tensors(gathered),
            "scaler": precision.state_dict(), "data": stream.state_dict(), **extra,
        }, keep=cfg.keep_checkpoints)
    dist.barrier()
