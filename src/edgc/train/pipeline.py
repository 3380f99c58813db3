"""Pipeline × data-parallel training: GPT-2 split into stages with torch.distributed.pipelining,
each stage a DDP module over its own data-parallel group, with EDGC and the DAC.

Layout (a DeviceMesh of shape (pp, dp), names "pp" and "dp"): global rank = p * dp + d.
Stage p of replica d talks to stages p±1 of replica d over the "pp" group, and syncs its
gradient with the other replicas of stage p over the "dp" group.

The model stays plain: `split_gpt` cuts a built GPT into stage modules. Stage 0 owns the
token and position embeddings, the last stage the final norm and the head. GPT-2 ties the
head to the token embedding; across stages the head gets its own copy of that matrix,
both start equal, and after each step's DP sync their gradients are summed over the
first and last stage of each replica (as Megatron does), so they stay equal and the
pipelined model computes exactly what the unsplit one does.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP

from edgc.atomic import atomic_write
from edgc.comm import EDGCState, edgc_hook
from edgc.comm.activation import ActivationGradCompressor, Carrier, Unpack
from edgc.comm.baselines import AllReduceState, allreduce_hook
from edgc.comm.pipeline import EDGCPipelineStage, StageAlignment
from edgc.comm.replicas import gather_replicas, replica_entry, tensors_digest
from edgc.config import EDGCConfig
from edgc.data import BatchStream, TokenFile
from edgc.models import build_model
from edgc.models.gpt2 import GPT
from edgc.train.checkpoint import (
    CHECKPOINT_NAME,
    check_compatible,
    load_checkpoint,
    save_checkpoint,
)
from edgc.train.common import (
    DivergenceGuard,
    compile_blocks,
    lr_at,
    param_groups,
    restore_rank,
    restore_resized_stage,
    resumed_stream,
    tell_learning_rate,
)
from edgc.train.common import model_config as model_config_of
from edgc.train.config import TrainConfig
from edgc.train.emulate import emulate_device_time
from edgc.train.evaluation import EvalResult, LossMoments, block_losses, eval_batches, eval_starts, write_evaluation
from edgc.train.launch import report_step
from edgc.train.metrics import MetricsWriter
from edgc.train.progress import ProgressDisplay
from edgc.train.tensor_parallel import apply_tp, to_file_layout, to_tp_layout

__all__ = ["GPTStage", "split_gpt", "stage_blocks", "train_pipeline_worker"]


def stage_blocks(n_layer: int, stages: int) -> list[range]:
    """The block indices of each stage: as even as possible, earlier stages one fewer
    (stage 0 also runs the embedding, the last stage the head)."""
    if not 1 <= stages <= n_layer:
        raise ValueError(f"cannot split {n_layer} blocks into {stages} stages")
    base, extra = divmod(n_layer, stages)
    sizes = [base + (1 if p >= stages - extra else 0) for p in range(stages)]
    starts = [sum(sizes[:p]) for p in range(stages)]
    return [range(s, s + n) for s, n in zip(starts, sizes, strict=True)]


class GPTStage(nn.Module):
    """One pipeline stage of a GPT: (embedding) -> blocks -> (final norm, head).

    Input: token ids (B, T) on stage 0, else hidden states (B, T, C). Output: logits
    (B, T, V) on the last stage, else hidden states (B, T, C).
    """

    def __init__(self, model: GPT, blocks: range, first: bool, last: bool, activation_rank: int = 0,
                 seed: int = 0) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.n_embd = model.config.n_embd  # C, the width of the hidden states it passes on
        # low-rank activation gradients (comm/activation.py): this stage sends a carrier
        # forward (not last) and compresses what it sends backward (not first)
        self.activation_rank = activation_rank
        self.compressor = ActivationGradCompressor(activation_rank, seed) if activation_rank and not first else None
        if first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        self.h = nn.ModuleList(model.h[i] for i in blocks)
        if last:
            self.ln_f = model.ln_f
            self.lm_head = nn.Linear(model.config.n_embd, model.config.vocab_size, bias=False)
            # the head's own copy of the tied matrix (the first stage keeps wte)
            self.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())

    def forward(self, x: torch.Tensor, carrier: torch.Tensor | None = None) -> Any:
        if self.first:
            pos = torch.arange(x.shape[1], dtype=torch.long, device=x.device)  # (T,)
            x = self.drop(self.wte(x) + self.wpe(pos))  # (B, T, C)
        elif carrier is not None:
            x = Unpack.apply(x, carrier, self.compressor)  # (B, T, C); its gradient goes back compressed
        for block in self.h:
            x = block(x)  # (B, T, C)
        if self.last:
            return self.lm_head(self.ln_f(x))  # (B, T, V)
        if self.activation_rank:
            return x.detach(), Carrier.apply(x, self.activation_rank)  # (B, T, C), (B, T + C, r)
        return x

    def tied_weight(self) -> torch.Tensor | None:
        """The embedding on the first stage, the head on the last (None in between)."""
        if self.first:
            return self.wte.weight
        if self.last:
            return self.lm_head.weight
        return None


def split_gpt(model: GPT, stages: int, activation_rank: int = 0, seed: int = 0) -> list[GPTStage]:
    """Cut `model` into `stages` GPTStage modules (sharing its parameters, except the head's
    copy of the tied embedding). `activation_rank` > 0 compresses the activation gradients
    sent backward between stages to that rank."""
    if stages < 2:
        raise ValueError(f"a pipeline needs at least 2 stages, got {stages}")
    ranges = stage_blocks(model.config.n_layer, stages)
    return [GPTStage(model, r, p == 0, p == stages - 1, activation_rank, seed + p) for p, r in enumerate(ranges)]


class _Layout:
    """This rank's place in the (pp, dp) mesh, or (pp, dp, tp) with tensor parallelism (TP
    innermost), and its process groups."""

    def __init__(self, cfg: TrainConfig, rank: int, world: int, device: torch.device) -> None:
        cfg.check_layout(world)
        self.pp, self.tp = cfg.pp, cfg.tp
        self.dp = world // (cfg.pp * cfg.tp)
        self.stage, rest = divmod(rank, self.dp * self.tp)
        self.replica, self.tp_rank = divmod(rest, self.tp)
        self.tp_mesh: Any = None
        self.tp_group: Any = None
        self.control_group: Any = None  # the stage's replicas x TP ranks (None: the DP group)
        if self.tp == 1:
            mesh = init_device_mesh(device.type, (self.pp, self.dp), mesh_dim_names=("pp", "dp"))
        else:
            mesh = init_device_mesh(device.type, (self.pp, self.dp, self.tp), mesh_dim_names=("pp", "dp", "tp"))
            self.tp_mesh, self.tp_group = mesh["tp"], mesh.get_group("tp")
            size = self.dp * self.tp  # (every rank makes every stage's group, in order)
            self.control_group, _ = dist.new_subgroups_by_enumeration(
                [list(range(p * size, (p + 1) * size)) for p in range(self.pp)])
        self.pp_group = mesh.get_group("pp")
        self.dp_group = mesh.get_group("dp")
        # the tied embedding/head: first and last stage of each replica and TP rank (every
        # rank makes every group, in the same order, as new_group requires)
        self.tied_group = None
        if self.pp == 2:
            self.tied_group = self.pp_group
        else:
            for d in range(self.dp * self.tp):
                g = dist.new_group([d, (self.pp - 1) * self.dp * self.tp + d])
                if d == self.replica * self.tp + self.tp_rank and self.stage in (0, self.pp - 1):
                    self.tied_group = g
        self.first, self.last = self.stage == 0, self.stage == self.pp - 1

    @property
    def shape(self) -> tuple[int, ...]:
        """(pp, dp), or (pp, dp, tp) with tensor parallelism (what checkpoints record)."""
        return (self.pp, self.dp, self.tp) if self.tp > 1 else (self.pp, self.dp)


def _split(p: torch.Tensor) -> bool:
    """Whether tensor parallelism splits `p` (else every TP rank holds it whole)."""
    return isinstance(p, DTensor) and any(not placement.is_replicate() for placement in p.placements)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _attach(cfg: TrainConfig, layout: _Layout, stage: EDGCPipelineStage) -> Any:
    """The stage's DP sync: plain all-reduce ("none") or EDGC with the DAC (edgc, powersgd)."""
    if cfg.method == "none":
        state: Any = AllReduceState(layout.dp_group)
        stage.register_comm_hook(state, allreduce_hook)
        return state
    alignment = StageAlignment(layout.stage, layout.pp, layout.pp_group, cfg.dac_config())
    # (with TP: one rank agreed over the stage's replicas x TP ranks, and the tensors every
    # TP rank holds whole counted in the signals by the first only)
    copies = [p for p in stage.submod.parameters() if not _split(p)] if layout.tp_rank > 0 else []
    state = EDGCState(layout.dp_group, EDGCConfig(**cfg.edgc), alignment=alignment,
                      control_group=layout.control_group, count_once=copies)
    stage.register_comm_hook(state, edgc_hook)
    return state


def _loss_fn(microbatches: int):
    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # mean over the micro-batch, divided by the micro-batch count: the micro-batches'
        # gradients then sum to the whole batch's mean gradient before the DP sync
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-1)
        return loss / microbatches
    return loss_fn


def _run(schedule: Any, stage: EDGCPipelineStage, layout: _Layout, x: torch.Tensor, y: torch.Tensor) -> float | None:
    """One schedule step; returns the batch's mean loss on the last stage."""
    losses: list[torch.Tensor] = []
    with stage.no_sync():
        if layout.first:
            schedule.step(x)
        elif layout.last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
    return float(sum(loss.detach().double() for loss in losses)) if layout.last else None


def _clip(stage_mod: GPTStage, layout: _Layout, max_norm: float) -> torch.Tensor:
    """Clip the whole pipeline's gradient norm (the tied matrix counted once, as unsplit;
    with TP each shard once, and a tensor every TP rank holds whole once)."""
    grads = [(p, _local(p.grad)) for p in stage_mod.parameters() if p.grad is not None]
    skip = stage_mod.lm_head.weight if layout.last and layout.pp > 1 else None
    sq = torch.zeros(1, dtype=torch.float64, device=grads[0][1].device)
    for p, g in grads:
        if p is not skip and (layout.tp_rank == 0 or _split(p)):
            sq += g.detach().double().pow(2).sum()
    if layout.tp_group is not None:
        # collective: all-reduce SUM of 1 float64 over the TP group
        dist.all_reduce(sq, group=layout.tp_group)
    # collective: all-reduce SUM of 1 float64 over the pipeline group
    dist.all_reduce(sq, group=layout.pp_group)
    norm = sq.sqrt().float()
    if max_norm > 0 and bool(torch.isfinite(norm)):
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for _, g in grads:
            g.mul_(coef)
    return norm


@torch.no_grad()
def _evaluate(schedule: Any, stage: EDGCPipelineStage, layout: _Layout, val: TokenFile, cfg: TrainConfig,
              device: torch.device) -> EvalResult:
    """Validation loss and its standard error over the fixed evaluation blocks (see
    edgc.train.evaluation; the same blocks as unsplit training), block i on replica i mod
    dp, run through the schedule forward only. The last stage computes each block's loss
    from the schedule's merged output; the other stages add nothing to the sums. Every
    rank must call it; it returns the same result on all."""
    assert cfg.block_size is not None  # (resolved: TrainConfig.resolve filled it in)
    every = eval_starts(len(val), cfg.block_size, cfg.eval_tokens)
    moments = LossMoments(device, starts=every)
    mine = np.arange(len(every))[layout.replica :: layout.dp]  # (this replica's block numbers)
    # (every stage of a replica walks the same blocks, so the schedule's sends and
    # receives pair up; the padded last batch keeps the micro-batch shapes fixed)
    for i, batch in enumerate(eval_batches(val, every[mine], cfg.block_size, cfg.batch_size, device)):
        with stage.no_sync():
            if layout.first:
                schedule.eval(batch.x)
            elif layout.last:
                logits = schedule.eval(target=batch.y, losses=[])  # (B, T, V), the micro-batches merged
                if layout.tp_rank == 0:  # (the other TP ranks compute the same losses)
                    first = i * cfg.batch_size
                    moments.add(block_losses(logits, batch.y)[: batch.valid], mine[first : first + batch.valid])
            else:
                schedule.eval()
    return moments.result(cfg.block_size)


# Per-rank values gathered to rank 0 each step for the per-stage metrics.
_FIELDS = ("stage", "replica", "tp", "rank", "comm_time", "bytes_sent", "bytes_uncompressed", "sync_start", "sync_end",
           "step_start", "step_end", "forward", "backward", "sync", "entropy", "compress_time", "entropy_time",
           "compress", "loss", "p2p_bytes", "critical_rho", "window_norm", "lr_drop", "noise_scale")


def train_pipeline_worker(rank: int, world: int, cfg_dict: dict[str, Any], data_dir: str,
                          resume: str | None) -> dict[str, Any]:
    """One rank of pipeline × data-parallel training. Rank 0 writes metrics and checkpoints,
    and its result's "diverged" is its DivergenceGuard.verdict (see train_worker)."""
    cfg = TrainConfig.from_dict(cfg_dict)
    use_cuda = dist.get_backend() == "nccl"
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if use_cuda else torch.device("cpu")
    layout = _Layout(cfg, rank, world, device)
    # (resolved: TrainConfig.resolve filled these in)
    assert cfg.microbatches is not None and cfg.block_size is not None
    assert cfg.eval_every is not None and cfg.checkpoint_every is not None
    data = Path(data_dir)
    meta = json.loads((data / "meta.json").read_text())
    train_tokens, val_tokens = TokenFile(data / "train.bin"), TokenFile(data / "val.bin")

    torch.manual_seed(cfg.seed)  # every rank builds the same whole model, then keeps its stage
    model = build_model(cfg.preset, vocab_size=meta["vocab_size"], block_size=cfg.block_size)
    stage_mod = split_gpt(model, layout.pp, cfg.activation_rank, cfg.seed)[layout.stage].to(device)
    del model
    if cfg.compile:
        compile_blocks(stage_mod.h)
    emulate_device_time(stage_mod.h, cfg.emulated_device_ms)
    submodule: nn.Module = stage_mod
    if layout.tp_mesh is not None:  # (DDP takes no DTensor parameters: the stage syncs itself after its sends)
        apply_tp(stage_mod, layout.tp_mesh, vocab_parallel=cfg.vocab_parallel)
    else:
        submodule = DDP(stage_mod, process_group=layout.dp_group, bucket_cap_mb=cfg.bucket_cap_mb,
                        device_ids=[device.index] if use_cuda else None)
    inputs, outputs = _stage_examples(cfg, layout, stage_mod.n_embd, meta["vocab_size"], device)
    stage = EDGCPipelineStage(submodule, layout.stage, layout.pp, device, layout.pp_group,
                              sync_after_send=cfg.sync_after_send, bucket_cap_mb=cfg.bucket_cap_mb,
                              input_args=inputs, output_args=outputs)
    hook_state = _attach(cfg, layout, stage)
    mb = cfg.microbatches
    schedule_cls = Schedule1F1B if cfg.schedule == "1f1b" else ScheduleGPipe
    schedule = schedule_cls(stage, n_microbatches=mb, loss_fn=_loss_fn(mb), scale_grads=False)
    opt = torch.optim.AdamW(param_groups(stage_mod, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95),
                            fused=use_cuda or None)
    stream = BatchStream(train_tokens, cfg.batch_size, cfg.block_size, seed=cfg.seed, sequences=layout.dp)

    model_config = model_config_of(cfg, meta["vocab_size"])
    start = 0
    if resume:
        ckpt = load_checkpoint(resume, trust=cfg.trust_checkpoint)
        check_compatible(ckpt, world_size=world, preset=cfg.preset, method=cfg.method, model_config=model_config,
                         layout=layout.shape)
        load = _load_tp if layout.tp > 1 else None
        saved_dp = int(ckpt["layout"][1])
        if saved_dp == layout.dp:
            start = restore_rank(ckpt, ckpt["stages"][layout.stage], stage_mod, opt, hook_state, load_weights=load)
            if stage_mod.compressor is not None:
                stage_mod.compressor.load_state_dict(replica_entry(ckpt["replicas"])["activation"])
        else:  # (another number of replicas: check_compatible allowed it)
            start = restore_resized_stage(ckpt, ckpt["stages"][layout.stage], stage_mod, opt, hook_state,
                                          stage_mod.compressor, stage=layout.stage, replica=layout.replica,
                                          tp_rank=layout.tp_rank, tp=layout.tp, load_weights=load)
        # (replica j's batches: first held by the entry of stage 0's replica j, rank j * tp)
        stream = resumed_stream(ckpt, train_tokens, cfg, replica_ranks=[j * layout.tp for j in range(saved_dp)],
                                accum=1)
        del ckpt

    writer = MetricsWriter.for_run(cfg, resume_step=start if resume else None) if rank == 0 else None
    display = ProgressDisplay(cfg.steps, start, enabled=cfg.progress and rank == 0)
    tokens_per_step = cfg.batch_size * cfg.block_size * layout.dp
    prev = hook_state.stats()
    skipped = 0
    guard = DivergenceGuard(cfg.max_nonfinite_steps, cfg.out, start if resume else None)
    val = None
    try:
        last = min(cfg.steps, cfg.stop_after or cfg.steps)
        for step in range(start + 1, last + 1):
            report_step(step)
            lr = lr_at(step, cfg)
            for group in opt.param_groups:
                group["lr"] = lr
            tell_learning_rate(hook_state, lr)
            stage.times.reset()
            if stage_mod.compressor is not None:
                stage_mod.compressor.start_step()
            p2p_before = stage_mod.compressor.bytes_sent if stage_mod.compressor is not None else 0
            t_wall, t0 = time.time(), time.perf_counter()
            ((x, y),) = stream.step(layout.dp, 1, layout.replica, device)  # every stage draws alike
            loss = _run(schedule, stage, layout, x, y)
            t_synced = time.perf_counter()
            tied = stage_mod.tied_weight()
            if layout.tied_group is not None and tied is not None and tied.grad is not None:
                # collective: all-reduce SUM of the tied matrix's gradient (this TP rank's rows
                # with --vocab-parallel), first + last stage
                dist.all_reduce(_local(tied.grad), group=layout.tied_group)
            norm = _clip(stage_mod, layout, cfg.grad_clip)
            alignment = getattr(hook_state, "alignment", None)
            if alignment is not None and not (alignment.decisions
                                              and alignment.decisions[-1]["step"] == hook_state.step):
                # the first pipeline-wide collectives after the sync wait for the last stage
                # to finish (on window ends the DAC exchange inside the sync did the waiting)
                alignment.observe_wait(time.perf_counter() - t_synced)
            if torch.isfinite(norm):
                opt.step()
            else:  # the same norm on every stage (all-reduced): all skip alike
                skipped += 1
            opt.zero_grad(set_to_none=True)
            if use_cuda:
                torch.cuda.synchronize()
            step_time = time.perf_counter() - t0

            stats = hook_state.stats()
            times = stage.times
            mine = torch.tensor([
                layout.stage, layout.replica, layout.tp_rank, stats.step_rank,
                stats.comm_seconds - prev.comm_seconds, stats.bytes_sent - prev.bytes_sent,
                stats.bytes_uncompressed - prev.bytes_uncompressed, times.sync_start, times.sync_end,
                t_wall, t_wall + step_time, float(times.forward), float(times.backward), float(times.sync),
                stats.entropy,
                stats.compress_seconds - prev.compress_seconds, stats.entropy_seconds - prev.entropy_seconds,
                float(stats.step_phase == "compress"), loss if loss is not None else 0.0,
                _p2p_bytes(cfg, layout, stage_mod, p2p_before),
                stats.critical_rho, stats.window_norm, float(stats.lr_drop), stats.noise_scale,
            ], dtype=torch.float64, device=device)
            prev = stats
            gathered = [torch.empty_like(mine) for _ in range(world)]
            # collective (metrics only): all-gather of len(_FIELDS) = 23 float64 per rank
            dist.all_gather(gathered, mine)
            rows = [dict(zip(_FIELDS, g.tolist(), strict=True)) for g in gathered]
            record = _record(step, lr, rows, layout, tokens_per_step, float(norm), skipped)
            val = None
            if step % cfg.eval_every == 0 or step == cfg.steps:
                val = _evaluate(schedule, stage, layout, val_tokens, cfg, device)
            if writer is not None:
                writer.write(record)
                if val is not None:
                    write_evaluation(writer, step, val, folder=cfg.out)
            display.update(step, record, stats, val.loss if val is not None else None)
            guard.observe(step, record["loss"], record["grad_norm"])
            if step % cfg.checkpoint_every == 0 or step == last:
                _checkpoint(cfg, step, world, rank, layout, stage_mod, opt, hook_state, stream, model_config, guard)
    finally:
        display.close()
        if writer is not None:
            writer.close()
    alignment = getattr(hook_state, "alignment", None)
    return {"param_digest": tensors_digest(_local(v) for v in stage_mod.state_dict().values()), "skipped": skipped,
            "stats": hook_state.stats(), "stage": layout.stage, "replica": layout.replica,
            "decisions": alignment.decisions if alignment is not None else [],
            "diverged": guard.verdict(val.loss if val is not None else None) if rank == 0 else None}


def _record(step: int, lr: float, rows: list[dict[str, float]], layout: _Layout, tokens_per_step: int,
            grad_norm: float, skipped: int) -> dict[str, Any]:
    """The step's metrics record: the usual fields (stage 0's compressor, one replica's
    bytes over all its stages and TP ranks) plus per-stage lists, index = stage."""
    by_stage = [[r for r in rows if int(r["stage"]) == p] for p in range(layout.pp)]
    t_begin = min(r["step_start"] for r in rows)
    step_time = max(r["step_end"] for r in rows) - t_begin
    def worst(p: int, key: str) -> float:
        return max(r[key] for r in by_stage[p])
    stage_step = [worst(p, "step_end") - min(r["step_start"] for r in by_stage[p]) for p in range(layout.pp)]
    replica0 = [next(r for r in by_stage[p] if int(r["replica"]) == 0) for p in range(layout.pp)]
    sent = [sum(int(r["bytes_sent"]) for r in by_stage[p] if int(r["replica"]) == 0) for p in range(layout.pp)]
    whole = sum(int(r["bytes_uncompressed"]) for r in rows if int(r["replica"]) == 0)
    s0 = replica0[0]
    loss = sum(r["loss"] for r in by_stage[-1]) / len(by_stage[-1])
    return {
        "step": step, "kind": "train", "loss": loss, "lr": lr,
        "tokens_per_s": tokens_per_step / step_time, "step_time": step_time,
        "comm_time": max(worst(p, "comm_time") for p in range(layout.pp)),
        "compress_time": s0["compress_time"], "entropy_time": s0["entropy_time"],
        "bytes_sent": sum(sent), "bytes_uncompressed": whole,
        "rank": int(s0["rank"]), "entropy": s0["entropy"], "phase": "compress" if s0["compress"] else "warmup",
        # stage 0's window signals (its rank drives the DAC)
        "critical_rho": s0["critical_rho"], "window_norm": s0["window_norm"], "lr_drop": bool(s0["lr_drop"]),
        "noise_scale": s0["noise_scale"],
        "grad_norm": grad_norm, "skipped": skipped,
        "stage_rank": [int(r["rank"]) for r in replica0],
        "stage_comm_time": [worst(p, "comm_time") for p in range(layout.pp)],
        "stage_bytes_sent": sent,
        # activations forward and activation gradients backward, to the neighbour stages
        "stage_p2p_bytes": [int(r["p2p_bytes"]) for r in replica0],
        # seconds from the step's start (earliest rank) to the end of each stage's DP sync
        "stage_sync_end": [worst(p, "sync_end") - t_begin for p in range(layout.pp)],
        # compute (forward + backward) and idle: the rest of the stage's step (bubbles,
        # waiting for activations, gradients and the pipeline's collectives, and the
        # optimiser step)
        "stage_compute_time": [worst(p, "forward") + worst(p, "backward") for p in range(layout.pp)],
        "stage_idle_time": [max(0.0, stage_step[p] - worst(p, "forward") - worst(p, "backward") - worst(p, "sync"))
                            for p in range(layout.pp)],
    }


def _stage_examples(cfg: TrainConfig, layout: _Layout, n_embd: int, vocab: int,
                    device: torch.device) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Example inputs and outputs of one micro-batch for this stage (zeros; shapes, dtypes
    and requires_grad are what the pipeline needs to know)."""
    # (resolved: TrainConfig.resolve filled these in)
    assert cfg.microbatches is not None and cfg.block_size is not None
    mb, t = cfg.batch_size // cfg.microbatches, cfg.block_size
    r = min(cfg.activation_rank, t, n_embd)

    def hidden() -> tuple[torch.Tensor, ...]:
        x = torch.zeros(mb, t, n_embd, device=device, requires_grad=not r)
        return (x, torch.zeros(mb, t + n_embd, r, device=device, requires_grad=True)) if r else (x,)

    inputs = (torch.zeros(mb, t, dtype=torch.long, device=device),) if layout.first else hidden()
    outputs = (torch.zeros(mb, t, vocab, device=device, requires_grad=True),) if layout.last else hidden()
    return inputs, outputs


def _p2p_bytes(cfg: TrainConfig, layout: _Layout, stage_mod: GPTStage, compressed_before: int) -> int:
    """Bytes this stage sent to its neighbours in the step: activations (and carriers)
    forward unless last, activation gradients backward unless first."""
    # (resolved: TrainConfig.resolve filled these in)
    assert cfg.microbatches is not None and cfg.block_size is not None
    mb = cfg.batch_size // cfg.microbatches
    c = stage_mod.n_embd
    item = next(stage_mod.parameters()).element_size()
    whole = mb * cfg.block_size * c * item  # one micro-batch's activation (B, T, C)
    n = 0
    if not layout.last:
        r = min(cfg.activation_rank, cfg.block_size, c)
        n += cfg.microbatches * (whole + (mb * (cfg.block_size + c) * r * item if r else 0))
    if not layout.first:
        comp = stage_mod.compressor
        n += comp.bytes_sent - compressed_before if comp is not None else cfg.microbatches * whole
    return n


def _checkpoint(cfg: TrainConfig, step: int, world: int, rank: int, layout: _Layout, stage_mod: GPTStage,
                opt: torch.optim.Optimizer, hook_state: Any, stream: BatchStream, model_config: dict,
                guard: DivergenceGuard) -> None:
    """Gather every rank's state to rank 0 (stage weights from replica 0), which writes
    atomically unless a stage's weights are not finite (the last good checkpoint is kept)."""
    mine: dict[str, Any] = {"comm": hook_state.state_dict(), "torch_rng": torch.get_rng_state()}
    if stage_mod.compressor is not None:
        mine["activation"] = stage_mod.compressor.state_dict()
    if layout.replica == 0:  # (with TP, a collective over the TP group: the whole tensors)
        mine["stage"] = _stage_weights(stage_mod, opt, layout) if layout.tp > 1 else {
            "model": {k: v.cpu() for k, v in stage_mod.state_dict().items()}, "optimizer": opt.state_dict()}
    gathered = gather_replicas(mine, dst=0)  # (every rank's state to rank 0: edgc.comm.replicas)
    if rank == 0:
        assert gathered is not None
        stages = [gathered[p * layout.dp * layout.tp]["stage"] for p in range(layout.pp)]
        replicas = [{k: v for k, v in g.items() if k != "stage"} for g in gathered]
        _write_decisions(Path(cfg.out) / "dac.jsonl", replicas)
        if guard.may_save(step, [s["model"] for s in stages]):  # (else it says why not)
            save_checkpoint(Path(cfg.out) / CHECKPOINT_NAME, {
                "step": step, "world_size": world, "layout": list(layout.shape), "train": cfg.to_dict(),
                "model_config": model_config, "stages": stages, "replicas": replicas, "data": stream.state_dict(),
            }, keep=cfg.keep_checkpoints)
    dist.barrier()


def _stage_weights(stage_mod: GPTStage, opt: torch.optim.Optimizer, layout: _Layout) -> dict[str, Any]:
    """A TP stage's {"model", "optimizer"} as one process would hold them: whole tensors on
    the CPU (a collective over the TP group per split tensor), c_attn's rows in GPT-2's
    order (edgc.train.tensor_parallel)."""
    def whole(t: Any) -> Any:
        return (t.full_tensor() if isinstance(t, DTensor) else t).cpu() if isinstance(t, torch.Tensor) else t

    model = {k: whole(v) for k, v in stage_mod.state_dict().items()}
    saved = opt.state_dict()
    names = _opt_names(stage_mod, opt)
    by_name = {names[i]: {k: whole(v) for k, v in s.items()} for i, s in saved["state"].items()}
    model, by_name_opt = to_file_layout(model, {"state": by_name}, layout.tp, stage_mod.n_embd)
    saved["state"] = {i: by_name_opt["state"][names[i]] for i in saved["state"]}
    return {"model": model, "optimizer": saved}


def _load_tp(stage_mod: nn.Module, opt: torch.optim.Optimizer, weights: dict[str, Any]) -> None:
    """Load what _stage_weights saved into a TP stage: each rank cuts its own shards from
    the whole tensors it read (no communication)."""
    assert isinstance(stage_mod, GPTStage)
    saved = dict(weights["optimizer"])
    names = _opt_names(stage_mod, opt)
    by_name = {names[int(i)]: s for i, s in saved["state"].items()}
    tp = next(p.device_mesh.size() for p in stage_mod.parameters() if isinstance(p, DTensor))
    model, by_name_opt = to_tp_layout(weights["model"], {"state": by_name}, tp, stage_mod.n_embd)
    params = dict(stage_mod.named_parameters())

    def cut(name: str, value: Any) -> Any:
        p = params.get(name)
        if not (isinstance(p, DTensor) and isinstance(value, torch.Tensor) and value.shape == p.shape):
            return value
        return distribute_tensor(value.to(p.device), p.device_mesh, p.placements, src_data_rank=None)

    with torch.no_grad():
        for name, value in model.items():
            target = stage_mod.get_parameter(name) if name in params else stage_mod.get_buffer(name)
            _local(target).copy_(_local(cut(name, value)))
    saved["state"] = {i: {k: cut(names[int(i)], v) for k, v in by_name_opt["state"][names[int(i)]].items()}
                      for i in saved["state"]}
    opt.load_state_dict(saved)


def _opt_names(stage_mod: nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    """The parameter names of the optimiser's state indices (its groups' order)."""
    names = {id(p): n for n, p in stage_mod.named_parameters()}
    return [names[id(p)] for group in opt.param_groups for p in group["params"]]


def _write_decisions(path: Path, replicas: list[dict[str, Any]]) -> None:
    """Every rank's DAC decisions so far, one JSON line each (step, stage, replica order),
    with the timings and T(r) fit each used; rewritten atomically at each checkpoint."""
    rows = []
    for rank, r in enumerate(replicas):
        alignment = r["comm"].get("alignment") if isinstance(r.get("comm"), dict) else None
        for d in (alignment or {}).get("decisions", []):
            rows.append({"global_rank": rank, **d})
    if not rows:
        return
    rows.sort(key=lambda d: (d["step"], d["stage"], d["global_rank"]))
    with atomic_write(path) as f:
        f.write("".join(json.dumps(d) + "\n" for d in rows).encode())
