"""Worker functions for the distributed tests (importable by spawned processes)."""

from __future__ import annotations

import copy
import io

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from edgc import EDGCConfig, EDGCState, edgc_hook


class MixedNet(nn.Module):
    """Linear, embedding, conv and 1-D parameters, enough for several small DDP buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 48)
        self.conv = nn.Conv1d(48, 40, kernel_size=3, padding=1)
        self.norm = nn.LayerNorm(40)
        self.fc1 = nn.Linear(40, 96)
        self.fc2 = nn.Linear(96, 64)
        self.scale = nn.Parameter(torch.ones(64))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)  # (B, T, 48)
        x = self.conv(x.transpose(1, 2)).transpose(1, 2)  # (B, T, 40)
        x = self.norm(F.gelu(x))
        x = self.fc2(F.gelu(self.fc1(x)))  # (B, T, 64)
        return x * self.scale


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    idx = torch.randint(0, 64, (4, 12), generator=g)
    target = torch.roll(idx, shifts=1, dims=1)
    return idx, target


def _make(config: EDGCConfig, seed: int = 0, bucket_cap_mb: float = 0.02):
    torch.manual_seed(seed)
    model = MixedNet()
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    state = EDGCState(process_group=None, config=config)
    ddp.register_comm_hook(state, edgc_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    return model, ddp, state, opt


def _lr(step: int, drop_at: int | None) -> float:
    """The learning rate of 0-based `step`: 0.5, a tenth of it from `drop_at` on."""
    return 0.5 * (0.1 if drop_at is not None and step >= drop_at else 1.0)


def _train(ddp, opt, state, rank: int, start: int, steps: int, lr_drop: int | dict | None = None, signals=None):
    """`lr_drop`: the learning rate is told to the state each step, and drops tenfold at
    that 0-based step (a dict: replica -> its own drop step, none for the others);
    `signals`: a list that gets each step's "critical" stats."""
    losses, ranks = [], []
    drop_at = lr_drop.get(rank) if isinstance(lr_drop, dict) else lr_drop
    for step in range(start, start + steps):
        if lr_drop is not None:
            for group in opt.param_groups:
                group["lr"] = _lr(step, drop_at)
            state.set_learning_rate(_lr(step, drop_at))
        idx, target = _batch(step, rank)
        loss = F.cross_entropy(ddp(idx).reshape(-1, 64), target.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grads_finite = all(bool(torch.isfinite(p.grad).all()) for p in ddp.parameters())
        if grads_finite:
            opt.step()
        losses.append(float(loss.detach()))
        ranks.append(state.stats().rank)
        if signals is not None:
            s = state.stats()
            signals.append((s.step_rank, s.critical_rho, s.window_norm, s.lr_drop, s.noise_scale))
    return losses, ranks


def train_and_report(rank: int, world: int, config_kwargs: dict, steps: int, lr_drop: int | None = None) -> dict:
    """Train MixedNet; return flattened parameters, losses, ranks, stats and each step's
    "critical" signals (`lr_drop`: see _train)."""
    config = EDGCConfig.from_dict(config_kwargs)
    model, ddp, state, opt = _make(config)
    signals: list = []
    losses, ranks = _train(ddp, opt, state, rank, 0, steps, lr_drop, signals)
    reducer = ddp.reducer
    n_buckets = len(reducer._get_zeros_like_grad_buckets()) if hasattr(reducer, "_get_zeros_like_grad_buckets") else -1
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"params": flat, "losses": losses, "ranks": ranks, "stats": state.stats(), "buckets": n_buckets,
            "history": list(state.sync.entropy_window.history),
            "group_ranks": {str(g.shape): g.q.shape[-1] for g in state.sync.compression.groups.values()},
            "eps_max": state.sync.gate.eps_max, "signals": signals}


def as_version_1(d: dict) -> dict:
    """A state_dict() as edgc 0.1 (state format 1) wrote it, for a policy whose state is its
    rank (as "cqm" and "noise" keep it: rank, rank_value, first_window)."""
    config = EDGCConfig.from_dict(d["config"])
    flat = {k: v for k, v in config.to_flat().items() if k not in ("warmup", "warmup_max_error")}
    flat.update(warmup_error_check=config.warmup == "release-check",
                warmup_max_error=config.warmup_max_error if config.warmup == "gradient" else None)
    policy = d["policy"]["state"]
    controller = {**d["entropy"], "rank": policy["rank"], "rank_value": policy.get("rank_value", policy["rank"]),
                  "first_window": policy.get("first_window", 0), "r_min": d["r_min"], "r_max": d["r_max"],
                  "moves": 0}
    keep = ("world_size", "replica", "step", "phase", "applied_rank", "stage_uncompressed", "step_phase",
            "step_rank", "r_min", "r_max", "window_gradient", "gate", "calibration", "alignment", "stats")
    return {"format": "edgc-state", "version": 1, **{k: d[k] for k in keep}, "config": flat,
            "controller": controller, **{k: v for k, v in d["compression"].items() if k != "residual_pending"}}


def resume_check(rank: int, world: int, config_kwargs: dict, n: int, legacy: bool = False,
                 lr_drop: int | None = None) -> dict:
    """2n straight steps vs n steps, checkpoint through bytes, fresh objects, n more.
    `legacy`: the checkpoint's state is made to look like one edgc 0.1 wrote before the
    pipelined mode (state format 1, with no "units" and no "sync_mode" in its config). `lr_drop`: see _train.
    Also each run's per-step "critical" signals."""
    config = EDGCConfig.from_dict(config_kwargs)
    model, ddp, state, opt = _make(config)
    straight_signals: list = []
    straight, _ = _train(ddp, opt, state, rank, 0, 2 * n, lr_drop, straight_signals)
    straight_params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    model, ddp, state, opt = _make(config)
    resumed_signals: list = []
    first, _ = _train(ddp, opt, state, rank, 0, n, lr_drop, resumed_signals)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "edgc": state.state_dict()}, buf)
    del model, ddp, state, opt
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    if legacy:
        ckpt["edgc"] = as_version_1(ckpt["edgc"])
        del ckpt["edgc"]["units"]
        del ckpt["edgc"]["config"]["sync_mode"]
    model, ddp, state, opt = _make(config, seed=123)  # different init: everything must come from the checkpoint
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    state.load_state_dict(ckpt["edgc"])
    second, _ = _train(ddp, opt, state, rank, n, n, lr_drop, resumed_signals)
    resumed_params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {
        "straight": straight,
        "resumed": first + second,
        "straight_params": straight_params,
        "resumed_params": resumed_params,
        "straight_signals": straight_signals,
        "resumed_signals": resumed_signals,
    }


def critical_signal_check(rank: int, world: int, config_kwargs: dict, steps: int, bad_steps: tuple = ()) -> dict:
    """MixedNet in float64 under a "critical" state: at each window end, the window norm and
    noise scale the state reports, and the same recomputed here from what DDP hands the
    optimiser (p.grad after the sync) and from this replica's own gradient (a plain
    backward of a copy of the model, outside DDP). At `bad_steps` the last replica's
    embedding gradient gets an inf at element (0, 1), which the GDS sample (every 4th
    element) does not hold; the recomputation leaves out steps whose average is not finite."""
    from edgc.entropy import is_sampled_step, sample_stride
    from edgc.policy.noise import noise_scale

    config = EDGCConfig.from_dict(config_kwargs)
    torch.manual_seed(0)
    model = MixedNet().double()
    shadow = copy.deepcopy(model)
    ddp = DDP(model, bucket_cap_mb=0.02)
    state = EDGCState(None, config)
    ddp.register_comm_hook(state, edgc_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    k = sample_stride(config.gradient_sample_rate)
    total, count, small, big = 0.0, 0, 0.0, 0.0
    reported, recomputed, ranks = [], [], []
    for step in range(1, steps + 1):
        idx, target = _batch(step, rank)
        shadow.load_state_dict(model.state_dict())
        shadow.zero_grad(set_to_none=True)
        F.cross_entropy(shadow(idx).reshape(-1, 64), target.reshape(-1)).backward()
        local = torch.cat([p.grad.reshape(-1)[::k] for p in shadow.parameters()])  # this replica's sample
        opt.zero_grad(set_to_none=True)
        handle = None
        if step in bad_steps and rank == world - 1:
            handle = model.emb.weight.register_hook(lambda g: g.index_put((torch.tensor(0), torch.tensor(1)),
                                                                          torch.tensor(float("inf"), dtype=g.dtype)))
        F.cross_entropy(ddp(idx).reshape(-1, 64), target.reshape(-1)).backward()
        if handle is not None:
            handle.remove()
        average = torch.cat([p.grad.reshape(-1)[::k] for p in model.parameters()])  # what the optimiser gets
        local_sq = local.square().sum().reshape(1)
        dist.all_reduce(local_sq)  # (the test's own collective, outside the hook)
        # (a non-finite step gets no update, as a GradScaler or a finite-norm check would do)
        if all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()):
            total, count = total + average, count + 1
            if is_sampled_step(step, config.iteration_sample_rate) and bool(torch.isfinite(local_sq).all()):
                small, big = small + float(local_sq) / world, big + float(average.square().sum())
            opt.step()
        ranks.append(state.stats().step_rank)
        if step % config.window == 0:
            stats = state.stats()
            reported.append((stats.window_norm, stats.noise_scale))
            recomputed.append((float(total.norm()) / count, noise_scale(small, big, world)))
            total, count, small, big = 0.0, 0, 0.0, 0.0
    return {"reported": reported, "recomputed": recomputed, "ranks": ranks}


def nonfinite_check(rank: int, world: int, config_kwargs: dict, bad_step: int, steps: int) -> dict:
    """Inject inf into one replica's gradient at bad_step; EF and Q must stay finite."""
    config = EDGCConfig.from_dict(config_kwargs)
    model, ddp, state, opt = _make(config)
    finite_after_bad = None
    skipped = 0
    for step in range(steps):
        idx, target = _batch(step, rank)
        out = ddp(idx)
        if step == bad_step and rank == world - 1:
            out = out * float("inf")
        loss = F.cross_entropy(out.reshape(-1, 64), target.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if all(bool(torch.isfinite(p.grad).all()) for p in ddp.parameters()):
            opt.step()
        else:
            skipped += 1
        if step == bad_step:
            finite_after_bad = all(
                bool(torch.isfinite(g.q).all()) and (g.error is None or bool(torch.isfinite(g.error).all()))
                for g in state.sync.compression.groups.values()
            )
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"skipped": skipped, "buffers_finite": finite_after_bad, "stats": state.stats(), "params": flat}


def mismatch_check(rank: int, world: int) -> str:
    """Loading a state from another model must raise a clear error at the first step."""
    config = EDGCConfig(policy="static", max_rank=4, warmup_steps=0)
    model, ddp, state, opt = _make(config)
    _train(ddp, opt, state, rank, 0, 2)
    saved = copy.deepcopy(state.state_dict())

    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(10, 20), nn.Linear(20, 3))
    ddp2 = DDP(other)
    state2 = EDGCState(None, config)
    state2.load_state_dict(saved)
    ddp2.register_comm_hook(state2, edgc_hook)
    try:
        ddp2(torch.randn(4, 10)).sum().backward()
    except Exception as exc:  # the hook's error surfaces through backward
        return str(exc)
    return "no error"


def train_plain(rank: int, world: int, steps: int) -> dict:
    """The same training with DDP's built-in all-reduce, for comparison."""
    torch.manual_seed(0)
    model = MixedNet()
    ddp = DDP(model, bucket_cap_mb=0.02)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    for step in range(steps):
        idx, target = _batch(step, rank)
        loss = F.cross_entropy(ddp(idx).reshape(-1, 64), target.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}


# ---------------------------------------------------------------- the two sync modes


class StackNet(nn.Module):
    """MixedNet's kinds of parameter plus three same-shape matrices (one group of three,
    cut across DDP's buckets)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 48)
        self.conv = nn.Conv1d(48, 40, kernel_size=3, padding=1)
        self.norm = nn.LayerNorm(40)
        self.mid = nn.ModuleList(nn.Linear(40, 40) for _ in range(3))
        self.out = nn.Linear(40, 64)
        self.scale = nn.Parameter(torch.ones(64))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)  # (B, T, 48)
        x = self.norm(F.gelu(self.conv(x.transpose(1, 2)).transpose(1, 2)))  # (B, T, 40)
        for layer in self.mid:
            x = x + F.gelu(layer(x))  # (B, T, 40)
        return self.out(x) * self.scale  # (B, T, 64)


MODES = {"whole-step": {"sync_mode": "whole-step"}, "pipelined": {"sync_mode": "pipelined"}}


def compare_modes(rank: int, world: int, config_kwargs: dict, steps: int, bucket_cap_mb: float,
                  runs: dict | None = None) -> dict:
    """StackNet in float64, trained once per run of `runs` (name -> config overrides; the
    two sync modes by default) from the same start: each step's averaged gradient and the
    rank it was sent at, the error feedback, Q and the units' plan at the end, and each
    all-reduce this replica issued: (step, bucket being handed over, was it the last,
    numel, dtype)."""
    out = {}
    original = dist.all_reduce
    for mode, overrides in (runs or MODES).items():
        torch.manual_seed(0)
        model = StackNet().double()
        ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
        state = EDGCState(None, EDGCConfig.from_dict({**config_kwargs, **overrides}))
        where, issued = [0, 0, False], []

        # (this run's `where` and `issued` are bound as defaults; unannotated: DDP checks
        # annotations as objects)
        def hook(state, bucket, where=where):
            where[1:] = [bucket.index(), bucket.is_last()]
            return edgc_hook(state, bucket)

        def spy(tensor, *args, where=where, issued=issued, **kwargs):
            issued.append((*where, tensor.numel(), str(tensor.dtype)))
            return original(tensor, *args, **kwargs)

        ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
        grads, ranks = [], []
        dist.all_reduce = spy
        try:
            for step in range(steps):
                where[0] = step + 1
                idx, target = _batch(step, rank)
                loss = F.cross_entropy(ddp(idx).reshape(-1, 64), target.reshape(-1))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
                ranks.append(state.stats().step_rank)
                opt.step()
        finally:
            dist.all_reduce = original
        compression = state.sync.compression
        out[mode] = {"grads": grads, "ranks": ranks, "units": compression.units, "stats": state.stats(),
                     "issued": issued,
                     "buckets": max(b for _, b, _, _, _ in issued) + 1,
                     "error": {str(k): g.error.clone() for k, g in compression.groups.items()},
                     "q": {str(k): g.q.clone() for k, g in compression.groups.items()},
                     "group_sizes": sorted(len(g.slots) for g in compression.groups.values())}
    return out


def nonfinite_late_bucket_check(rank: int, world: int, config_kwargs: dict, bad_step: int, steps: int) -> dict:
    """The last replica's embedding gradient (DDP's last bucket, computed last) gets an inf
    at bad_step; the error feedback and Q must come out of that step as they went in."""
    config = EDGCConfig.from_dict(config_kwargs)
    model, ddp, state, opt = _make(config)
    out = {"skipped": 0}
    for step in range(steps):
        idx, target = _batch(step, rank)
        loss = F.cross_entropy(ddp(idx).reshape(-1, 64), target.reshape(-1))
        opt.zero_grad(set_to_none=True)
        handle = None
        if step == bad_step:
            before = {k: (g.error.clone(), g.q.clone()) for k, g in state.sync.compression.groups.items()}
            if rank == world - 1:
                handle = model.emb.weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
        loss.backward()
        if handle is not None:
            handle.remove()
        if all(bool(torch.isfinite(p.grad).all()) for p in ddp.parameters()):
            opt.step()
        else:
            out["skipped"] += 1
        if step == bad_step:
            out["untouched"] = all(torch.equal(g.error, before[k][0]) and torch.equal(g.q, before[k][1])
                                   for k, g in state.sync.compression.groups.items())
            out["finite_buckets"] = [bool(torch.isfinite(p.grad).all()) for p in model.parameters()]
    out["params"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    out["stats"] = state.stats()
    return out


# ---------------------------------------------------------------- init order, pickling, replicas


def train_given_state(rank: int, world: int, state: EDGCState, steps: int) -> dict:
    """Train MixedNet with a state built elsewhere (pickled into this process by spawn)."""
    torch.manual_seed(0)
    model = MixedNet()
    ddp = DDP(model, bucket_cap_mb=0.02)
    ddp.register_comm_hook(state, edgc_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    _train(ddp, opt, state, rank, 0, steps)
    return {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "stats": state.stats(), "world_size": state.world_size}


def state_before_init(rank: int, world: int, config_kwargs: dict, store: str, steps: int) -> dict:
    """Build the state with no process group, then (re)initialise the group and train."""
    dist.destroy_process_group()
    state = EDGCState(None, EDGCConfig.from_dict(config_kwargs))
    assert state.world_size == 1  # nothing to know yet
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    return train_given_state(rank, world, state, steps)


def pickle_own_group(rank: int, world: int, config_kwargs: dict) -> dict:
    """A state on a new_group pickles, comes back without it, and says so when used."""
    import pickle

    group = dist.new_group(list(range(world)))
    state = EDGCState(group, EDGCConfig.from_dict(config_kwargs))
    copy_ = pickle.loads(pickle.dumps(state))
    out = {"group_after": copy_.process_group}
    torch.manual_seed(0)
    ddp = DDP(MixedNet(), bucket_cap_mb=0.02)
    ddp.register_comm_hook(copy_, edgc_hook)
    idx, target = _batch(0, rank)
    try:
        F.cross_entropy(ddp(idx).reshape(-1, 64), target.reshape(-1)).backward()
        out["error"] = "no error"
    except Exception as exc:
        out["error"] = str(exc)
    # given its group again, it trains
    again = pickle.loads(pickle.dumps(state))
    again.process_group = group
    result = train_given_state(rank, world, again, 6)
    out["params"] = result["params"]
    return out


def replica_check(rank: int, world: int, config_kwargs: dict) -> dict:
    """state_dict records the replica; rank 0's state is refused on rank 1 unless asked."""
    config = EDGCConfig.from_dict(config_kwargs)
    model, ddp, state, opt = _make(config)
    _train(ddp, opt, state, rank, 0, 6)
    saved = state.state_dict()
    objs: list = [None] * world
    dist.all_gather_object(objs, saved)
    out = {"replica": saved["replica"], "refused": None, "loaded_other": None}
    if rank == 1:
        try:
            EDGCState(None, config).load_state_dict(objs[0])
        except ValueError as exc:
            out["refused"] = str(exc)
        other = EDGCState(None, config)
        other.load_state_dict(objs[0], strict_replica=False)
        out["loaded_other"] = other.state_dict()["step"]
    return out


# ---------------------------------------------------------------- precision


class MixedDtypeNet(nn.Module):
    """bf16 matrices and 1-D tensors beside float32 ones."""

    def __init__(self, half: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.half = half
        self.scale = nn.Parameter(torch.ones(16))  # float32 1-D
        self.fc1 = nn.Linear(24, 48).to(half)
        self.fc2 = nn.Linear(48, 40, bias=False).to(half)
        self.fc3 = nn.Linear(40, 16)  # float32 matrix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x.to(self.half)))
        h = self.fc2(h).float()  # (B, 40)
        return self.fc3(h) * self.scale


def train_mixed_dtypes(rank: int, world: int, config_kwargs: dict, steps: int, half: str = "bfloat16") -> dict:
    torch.manual_seed(0)
    model = MixedDtypeNet(getattr(torch, half))
    ddp = DDP(model, bucket_cap_mb=0.002)
    state = EDGCState(None, EDGCConfig.from_dict(config_kwargs))
    ddp.register_comm_hook(state, edgc_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    sent = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 24, generator=g), torch.randn(8, 16, generator=g)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        before = state.stats().bytes_sent
        loss.backward()
        sent.append(state.stats().bytes_sent - before)
        opt.step()
    return {
        "params": torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]),
        "stats": state.stats(), "sent": sent,
        "groups": sorted((g.shape, str(g.dtype), g.q.shape[-1], str(g.q.dtype))
                         for g in state.sync.compression.groups.values()),
        "uncompressed": [state.sync.compression.slot_shapes[s] for s in state.sync.compression.uncompressed_slots],
    }


def train_scaled(rank: int, world: int, config_kwargs: dict, scales: list, tell: bool) -> dict:
    """float64 MixedNet; the loss is multiplied by scales[step] and the gradient divided by
    it after the sync (a GradScaler's work); `tell`: the state is told the scale."""
    torch.manual_seed(0)
    model = MixedNet().double()
    ddp = DDP(model, bucket_cap_mb=0.02)
    state = EDGCState(None, EDGCConfig.from_dict(config_kwargs))
    ddp.register_comm_hook(state, edgc_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    entropies, ranks = [], []
    for step, scale in enumerate(scales):
        idx, target = _batch(step, rank)
        loss = F.cross_entropy(ddp(idx).reshape(-1, 64), target.reshape(-1))
        if tell:
            state.set_grad_scale(scale)
        opt.zero_grad(set_to_none=True)
        (loss * scale).backward()
        for p in model.parameters():
            p.grad.div_(scale)
        opt.step()
        entropies.append(state.stats().entropy)
        ranks.append(state.stats().step_rank)
    return {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "entropies": entropies, "ranks": ranks}


def train_mixed_dtypes_cuda(rank: int, world: int, config_kwargs: dict, steps: int) -> dict:
    """MixedDtypeNet on this process's GPU (shared when there is one), under the hook."""
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = MixedDtypeNet().to(device)
    ddp = DDP(model, device_ids=[device.index], bucket_cap_mb=0.002)
    state = EDGCState(None, EDGCConfig.from_dict(config_kwargs))
    ddp.register_comm_hook(state, edgc_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 24, generator=g).to(device), torch.randn(8, 16, generator=g).to(device)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    return {"params": torch.cat([p.detach().float().cpu().reshape(-1) for p in model.parameters()]),
            "stats": state.stats()}


def evaluate_shared(rank: int, world: int, val_path: str, eval_tokens: int | None) -> dict:
    """The trainer's evaluation of one seeded tiny GPT, its blocks shared out over `world` ranks."""
    from edgc.data import TokenFile
    from edgc.models import build_model
    from edgc.train.config import TrainConfig
    from edgc.train.trainer import evaluate

    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=64, block_size=32)
    cfg = TrainConfig(block_size=32, batch_size=4, eval_tokens=eval_tokens)
    result = evaluate(model, TokenFile(val_path), cfg, rank, world, torch.device("cpu"))
    return {"loss": result.loss, "se": result.se, "blocks": result.blocks}


def torch_powersgd_resume_check(rank: int, world: int, n: int) -> dict:
    """torch's PowerSGD hook (our wrapper) on MixedNet in float64 over several DDP buckets:
    2n straight steps vs n steps, a checkpoint through bytes, fresh objects, n more. Also
    each bucket's layout at every step, and the saved error feedback against torch's
    buffers cut per parameter at the offsets DDP's bucket gave (not the wrapper's own)."""
    from edgc.comm.baselines import TorchPowerSGDState, torch_powersgd_hook

    def make(seed):
        torch.manual_seed(seed)
        model = MixedNet().double()
        ddp = DDP(model, bucket_cap_mb=0.03)
        state = TorchPowerSGDState(None, rank=4, start_iter=3, min_compression_rate=1.0, module=model)
        seen = []
        ids = {id(p): i for i, p in enumerate(model.parameters())}

        def hook(state, bucket):
            grads = bucket.gradients()
            base = bucket.buffer().storage_offset()
            seen.append((bucket.index(), [(ids[id(p)], g.storage_offset() - base, g.numel())
                                          for p, g in zip(bucket.parameters(), grads, strict=True)]))
            return torch_powersgd_hook(state, bucket)

        ddp.register_comm_hook(state, hook)
        return model, ddp, state, torch.optim.SGD(ddp.parameters(), lr=0.5), seen

    def steps(ddp, opt, start, count):
        losses = []
        for step in range(start, start + count):
            idx, target = _batch(step, rank)
            loss = F.cross_entropy(ddp(idx).reshape(-1, 64), target.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        return losses

    def layouts(seen, count):  # the bucket layout of each of the last `count` steps
        per_step, current = [], {}
        for b, lay in seen:
            if b in current:
                per_step.append(current)
                current = {}
            current[b] = lay
        per_step.append(current)
        return per_step[-count:]

    model, ddp, state, opt, seen = make(0)
    straight = steps(ddp, opt, 0, 2 * n)
    straight_params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    model, ddp, state, opt, seen = make(0)
    first = steps(ddp, opt, 0, n)
    saved_layout = layouts(seen, 1)[0]
    cut = {}
    for b, lay in saved_layout.items():
        for i, offset, numel in lay:
            cut[i] = state.inner.error_dict[b][offset:offset + numel]
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "comm": state.state_dict()}, buf)
    del model, ddp, state, opt
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    saved_error = {i: ckpt["comm"]["params"]["error"][i].reshape(-1) for i in cut}
    model, ddp, state, opt, seen = make(123)  # different init: everything must come from the checkpoint
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    state.load_state_dict(ckpt["comm"])
    second = steps(ddp, opt, n, n)
    resumed_params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {
        "straight": straight, "resumed": first + second,
        "straight_params": straight_params, "resumed_params": resumed_params,
        "saved_layout": saved_layout, "resumed_layouts": layouts(seen, n),
        "cut": cut, "saved_error": saved_error,
    }


def replicas_check(rank: int, world: int, out: str) -> dict:
    """edgc.checkpoint on every replica: gather to 1 and to all, scatter back, a file
    round trip, and a list of the wrong length given to scatter (every replica must
    raise, none may wait)."""
    from edgc.checkpoint import gather_states, load_states, restore_state, save_states

    config = EDGCConfig(warmup_steps=1, window=2, max_rank=4, min_rank=2)
    model, ddp, state, opt = _make(config)
    _train(ddp, opt, state, rank, 0, 3)
    on_one = gather_states(state, dst=1)
    on_all = gather_states(state, dst=None)
    fresh = EDGCState(None, config)
    restore_state(fresh, on_one, src=1)  # (rank 0 passes None: it gets its own from rank 1)
    scattered = fresh.state_dict()
    save_states(state, out, step=3)
    dist.barrier()  # (rank 0 has written the file)
    from_file = EDGCState(None, config)
    load_states(from_file, out, step=3)
    try:
        restore_state(EDGCState(None, config), on_all[:1] if rank == 0 else None, src=0)
        wrong_length = "no error"
    except ValueError as exc:
        wrong_length = str(exc)
    # the gathered entries are copies, the gathering replica's own too: changing what was
    # gathered afterwards changes none of them
    from edgc.comm.replicas import gather_replicas

    mine = {"x": torch.full((3,), float(rank))}
    got = gather_replicas(mine, dst=1)
    mine["x"].add_(10.0)
    gathered = None if got is None else [g["x"].tolist() for g in got]
    return {"mine": state.state_dict(), "on_one": on_one, "on_all": on_all, "scattered": scattered,
            "from_file": from_file.state_dict(), "wrong_length": wrong_length, "gathered": gathered}



class WideNet(nn.Module):
    """About 1.4M parameters: several DDP buckets at torch.compile's smallest bucket size
    (1 MiB: torch's DDPOptimizer refuses a smaller bucket size)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 256)
        self.fc1 = nn.Linear(256, 1024)
        self.norm = nn.LayerNorm(1024)
        self.fc2 = nn.Linear(1024, 1024)
        self.fc3 = nn.Linear(1024, 64)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.norm(F.gelu(self.fc1(self.emb(idx))))
        return self.fc3(F.gelu(self.fc2(x)))


def train_compiled(rank: int, world: int, config_kwargs: dict, steps: int, how: str) -> dict:
    """Train WideNet with the hook as a user who compiles would: `how` is "eager" (not
    compiled), "module" (model.compile() before DDP wraps it) or "ddp" (torch.compile of
    the DDP module). Either way torch splits the compiled graph at DDP's bucket boundaries
    (its DDPOptimizer), so the reducer hands buckets over during the backward pass. The
    aot_eager backend: the graphs and AOTAutograd's backward that inductor would compile,
    without the C++ build."""
    config = EDGCConfig.from_dict(config_kwargs)
    torch.manual_seed(0)
    model = WideNet()
    if how == "module":
        model.compile(backend="aot_eager")
    ddp = DDP(model, bucket_cap_mb=1)
    state = EDGCState(process_group=None, config=config)
    ddp.register_comm_hook(state, edgc_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    step_fn = torch.compile(ddp, backend="aot_eager") if how == "ddp" else ddp
    torch._dynamo.utils.counters.clear()
    losses, ranks = _train(step_fn, opt, state, rank, 0, steps)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    reducer = ddp.reducer
    n_buckets = len(reducer._get_zeros_like_grad_buckets()) if hasattr(reducer, "_get_zeros_like_grad_buckets") else -1
    return {"params": flat, "losses": losses, "ranks": ranks, "stats": state.stats(), "buckets": n_buckets,
            "graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"])}


def resize_check(rank: int, world: int, folder: str) -> dict:
    """A job of `world` replicas resumes the EDGC states that replicas_check saved from 2
    (at step 3, compressing): refused as they are, loaded with resize=True, then 3 more
    steps. Returns the state as loaded, the error raised without resize, and the phase,
    ranks and compressed steps that follow."""
    from edgc.checkpoint import load_states

    config = EDGCConfig(warmup_steps=1, window=2, max_rank=4, min_rank=2)
    model, ddp, state, opt = _make(config)
    try:
        load_states(state, folder, step=3)
        refused = "no error"
    except ValueError as exc:
        refused = str(exc)
    load_states(state, folder, step=3, resize=True)
    loaded = copy.deepcopy(state.state_dict())  # (the loaded tensors become the live state, which training changes)
    _, ranks = _train(ddp, opt, state, rank, 3, 3)
    stats = state.stats()
    return {"loaded": loaded, "refused": refused, "ranks": ranks, "phase": stats.phase,
            "compressed_steps": stats.compressed_steps, "step": stats.step}


def switch_check(rank: int, world: int, config_kwargs: dict) -> dict:
    """6 steps (4 warm-up, 2 compressed), 3 with `state.enabled = False`, 3 on again.
    Returns whether each switched-off step's gradient was the plain mean of the local ones
    (the same batch's gradient, all-reduced by hand), and the state and stats before and
    after those steps."""
    model, ddp, state, opt = _make(EDGCConfig.from_dict(config_kwargs))
    _train(ddp, opt, state, rank, 0, 6)
    before, stats_before = state.state_dict(), state.stats()
    state.enabled = False
    plain = []
    for step in range(6, 9):
        idx, target = _batch(step, rank)
        local = [torch.autograd.grad(F.cross_entropy(model(idx).reshape(-1, 64), target.reshape(-1)), p)[0]
                 for p in [next(model.parameters())]]
        for g in local:
            dist.all_reduce(g)
            g.div_(world)
        _train(ddp, opt, state, rank, step, 1)
        plain.append(torch.equal(next(model.parameters()).grad, local[0]))
    after, stats_after = state.state_dict(), state.stats()
    state.enabled = True
    _train(ddp, opt, state, rank, 9, 3)
    return {"plain": plain, "before": before, "after": after, "stats_before": stats_before,
            "stats_after": stats_after, "stats_end": state.stats(),
            "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}
