"""DiLoCo: H local steps on each replica, then one sync of the weights' change and an outer
Nesterov step; optionally with that change compressed by edgc's core.

    from edgc import EDGCConfig
    from edgc.diloco import DiLoCo

    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)     # the inner optimiser, as usual
    diloco = DiLoCo(model, opt, inner_steps=20)              # compression=EDGCConfig(max_rank=32): edgc-diloco
    for x, y in loader:                                      # the model is NOT wrapped in DDP
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        diloco.step()                                        # every 20th call: the outer step

The algorithm (DiLoCo, arXiv 2311.08105; torchft's `DiLoCo`):

- every replica starts from the same global weights θ and takes H inner steps of its own
  optimiser on its own data, with no communication;
- then the pseudo-gradient Δ = θ − θ_local is averaged over the replicas (one all-reduce of
  the model's size, in float32), and an outer SGD with Nesterov momentum applies it to θ:
  b ← μ b + Δ, θ ← θ − η (Δ + μ b) (torch.optim.SGD(nesterov=True); the paper's η 0.7 and
  μ 0.9);
- every replica sets its weights to θ. The inner optimiser's state is kept, and its learning
  rate schedule runs as usual.

So DiLoCo sends 1/H of DDP's bytes. With `compression=EDGCConfig(...)` (edgc-diloco) the
average of Δ goes through edgc's compression core instead, once per outer step: low rank with
error feedback and warm-started Q, the wire format, the rank policy, the warm-up and the
long-matrix rule, all counted in outer steps (the window, the warm-up and `total_steps`).
The error feedback is that core's, kept apart from the outer momentum. Only what the
outer momentum does not predict is compressed: Δ minus its least-squares fit to the momentum
buffer, tensor by tensor (a number per tensor more on the wire, no more memory).

On the int4 wire (`EDGCConfig(wire="int4")`: 4-bit codes, a code step 1/7 of a block's
largest value) DiLoCo keeps the error feedback of all of Δ itself, and the core none. Each
replica adds its kept error M - sent to the next pseudo-gradient: for a matrix the core
compressed, M less the average applied (what the core would keep, M - P Qᵀ); for a tensor
it sent whole, M less this replica's own rounding of it (4-bit codes, or int8 ones on the
uncompressed steps of the warm-up, which the core sends so: `_keep_error`). The core keeps
none for a tensor sent whole, which at int8 loses at most 1/254 of its block's largest
value a sync, at 4 bits 1/14. One buffer of the model's size in float32
(the core's own would cover only the compressed matrices).

Memory: θ and the momentum (two float32 copies of the model) on every replica, and with
compression edgc's state (error feedback and Q; on the int4 wire a third copy, the error
feedback, and Q). Checkpoints: `state_dict()` holds θ, the
momentum, the step and the compression state (this replica's error feedback). Between outer
steps the replicas' weights and inner optimiser states differ, so an exact resume in the
middle of an inner phase also needs each replica's own model and optimiser
(`edgc train --method diloco` saves them); at an outer step (`synced`) they are the same on
every replica.

Not built, and refused in one line: a model sharded by FSDP2 or tensor parallelism (DTensor
parameters), and a model wrapped in DDP (its all-reduce would run every step).
"""

from __future__ import annotations

import dataclasses
import io
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from edgc.comm.stats import EDGCStats
from edgc.comm.timing import LapSum, start_lap
from edgc.comm.wire import dequantize, quantize, wire_format
from edgc.config import EDGCConfig
from edgc.safeload import load_torch

__all__ = ["DiLoCo"]

_FORMAT = "edgc-diloco-state"
_VERSION = 1


def _shift(delta: torch.Tensor, fit: list[tuple[torch.Tensor, torch.Tensor]], sign: int) -> None:
    """delta ± c b, tensor by tensor in place (no copy of the model's size)."""
    for part, (c, b) in zip(delta.split([b.numel() for _, b in fit]), fit, strict=True):
        part.add_(c * b, alpha=sign)


class DiLoCo:
    """DiLoCo over `model` and its inner optimiser, on `process_group` (None: the world).

    `inner_steps` H >= 1; `outer_lr` > 0; `outer_momentum` in [0, 1) (Nesterov; 0: plain
    SGD); `compression`: an EDGCConfig (its `max_rank` given) to compress the pseudo-gradient
    with edgc's core, or None to all-reduce it whole. Call `step()` once after each inner
    optimiser step. Raises ValueError on a bad setting or a model it cannot serve."""

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer,
                 process_group: dist.ProcessGroup | None = None, *, inner_steps: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, compression: EDGCConfig | None = None) -> None:
        if isinstance(inner_steps, bool) or not isinstance(inner_steps, int) or inner_steps < 1:
            raise ValueError(f"DiLoCo: inner_steps={inner_steps!r} must be an integer >= 1 (H, the local steps "
                             "between syncs)")
        if isinstance(outer_lr, bool) or not (isinstance(outer_lr, (int, float)) and math.isfinite(outer_lr)
                                              and outer_lr > 0):
            raise ValueError(f"DiLoCo: outer_lr={outer_lr!r} must be a finite number > 0 (the paper's 0.7)")
        if isinstance(outer_momentum, bool) or not (isinstance(outer_momentum, (int, float))
                                                    and 0 <= outer_momentum < 1):
            raise ValueError(f"DiLoCo: outer_momentum={outer_momentum!r} must be in [0, 1) (the paper's 0.9)")
        if compression is not None and not isinstance(compression, EDGCConfig):
            raise TypeError(f"DiLoCo: compression must be an EDGCConfig or None, not {type(compression).__name__}")
        if isinstance(model, nn.parallel.DistributedDataParallel):
            raise ValueError("DiLoCo: the model is wrapped in DistributedDataParallel, whose all-reduce would run "
                             "at every inner step; give DiLoCo the plain model")
        params = [p for p in model.parameters() if p.requires_grad]
        if any(type(p.data).__name__ == "DTensor" or hasattr(p, "device_mesh") for p in params):
            raise ValueError("DiLoCo: the model's parameters are DTensors (FSDP2 or tensor parallelism), which "
                             "DiLoCo does not serve yet: each shard's pseudo-gradient over its replicate group is "
                             "not built")
        if not params:
            raise ValueError("DiLoCo: the model has no parameter that requires a gradient")
        self.model, self.inner_optimizer, self.group = model, inner_optimizer, process_group
        self.inner_steps = inner_steps
        self.params = params
        # θ, the global weights, in float32 (float64 for a float64 model): the outer step's
        # arithmetic, whatever the dtype the inner steps run in; and their optimiser
        self.dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
        self.global_params = [p.detach().to(self.dtype).clone() for p in params]
        self.outer_optimizer = torch.optim.SGD(self.global_params, lr=float(outer_lr), momentum=float(outer_momentum),
                                               nesterov=outer_momentum > 0)
        self.step_count = 0  # inner steps taken
        self.outer_steps = 0
        self.bytes_sent = 0
        self._comm = LapSum()  # DiLoCo's own all-reduces (the core times its own)
        self._numel = sum(p.numel() for p in params)
        self._ddp_bytes = sum(p.numel() * p.element_size() for p in params)  # (DDP's all-reduce, a step)
        self.sync: Any = None
        self.error: torch.Tensor | None = None  # the int4 wire's error feedback of all of Δ (the module doc)
        if compression is not None:
            from edgc.comm.sync import GradientSync

            if compression.wire == "int4" and compression.use_error_feedback:
                self.error = torch.zeros(self._numel, dtype=self.dtype, device=params[0].device)
                compression = dataclasses.replace(compression, use_error_feedback=False)
            self.sync = GradientSync(process_group, compression, eager=True)
            self._entries = [((0, k), tuple(p.shape)) for k, p in enumerate(params)]
            self.sync.declare([self._entries], [self.dtype])

    @property
    def synced(self) -> bool:
        """Whether the last step was an outer step (or none was taken): the replicas then
        hold the same weights."""
        return self.step_count % self.inner_steps == 0

    def step(self) -> bool:
        """Count one inner step; at every H-th, sync and take the outer step. Returns
        whether it did."""
        self.step_count += 1
        if self.step_count % self.inner_steps:
            return False
        self._outer_step()
        return True

    @torch.no_grad()
    def _outer_step(self) -> None:
        world = dist.get_world_size(self.group) if dist.is_initialized() else 1
        # Δ = θ - θ_local, one flat buffer in parameter order
        delta = torch.cat([(g - p.detach().to(self.dtype)).reshape(-1)
                           for g, p in zip(self.global_params, self.params, strict=True)])
        if self.sync is not None:
            fit = self._momentum_fit(delta, world)
            if fit is not None:
                _shift(delta, fit, -1)
            if self.error is not None:  # M = Δ + error, kept to subtract what was applied from
                delta.add_(self.error)
                self.error.copy_(delta)
            future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            self.sync.receive(delta, self._entries, future, True)
            if self.error is not None:
                self._keep_error(delta, world)
            if fit is not None:
                _shift(delta, fit, 1)
        elif world > 1:
            self._average(delta, world)
        for g, part in zip(self.global_params, delta.split([g.numel() for g in self.global_params]), strict=True):
            g.grad = part.view_as(g)
        self.outer_optimizer.step()
        for g, p in zip(self.global_params, self.params, strict=True):
            g.grad = None
            p.copy_(g)
        self.outer_steps += 1

    def _keep_error(self, applied: torch.Tensor, world: int) -> None:
        """The int4 wire's new error feedback, in `self.error`, which holds M: for a matrix
        the core compressed, M less the average applied (the core's own kind, M - P Qᵀ); for
        a tensor sent whole, M less this replica's own rounding of it, which is what it put
        on the wire (each tensor starts a block of its own there; 4-bit codes, or on an
        uncompressed step such as the warm-up's one-byte ones). With 2 replicas the
        average is exactly the mean of those roundings, so what every replica sent less what
        it kept averages to what was applied; with more, the sum is rounded a second time
        (edgc.comm.wire), which nobody keeps. Keeping M less the average for a whole tensor
        instead would carry each replica's difference from the average into its next
        pseudo-gradient, and sum those differences over the outer steps."""
        fmt = wire_format(self.sync.config.wire)
        code = (fmt if self.sync.step_rank > 0 else fmt.uncompressed).codec  # (the step's format: edgc.comm.step)
        assert code is not None and self.error is not None
        compression = self.sync.compression
        compressed = compression.compressed_slots() if self.sync.step_rank > 0 else set()
        sizes = [p.numel() for p in self.params]
        for k, (e, a) in enumerate(zip(self.error.split(sizes), applied.split(sizes), strict=True)):
            if world == 1 or compression.slot_of(self._entries[k][0]) in compressed:
                e.sub_(a)
            else:
                e.sub_(dequantize(quantize(e, code), e.numel(), code, e.dtype))

    def _momentum_fit(self, delta: torch.Tensor, world: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """edgc-diloco: the part of the average Δ that the outer momentum b predicts, c b per
        tensor with c = <Δ̄, b> / <b, b> (least squares), as (c, b flat) in parameter order.
        b is the same on every replica, and c the average of each replica's own fit (one
        all-reduce of a number per tensor), so only Δ - c b goes through the compressor and
        every replica adds the same c b back. None before the first outer step, or without
        momentum."""
        buffers = [self.outer_optimizer.state.get(g, {}).get("momentum_buffer") for g in self.global_params]
        if any(b is None for b in buffers):
            return None
        flat = [b.reshape(-1) for b in buffers]
        coefficients = torch.stack([torch.dot(local, b) / torch.dot(b, b).clamp_min(torch.finfo(b.dtype).tiny)
                                    for local, b in zip(delta.split([b.numel() for b in flat]), flat, strict=True)])
        if world > 1:
            self._average(coefficients, world)
        return list(zip(coefficients, flat, strict=True))

    def _average(self, t: torch.Tensor, world: int) -> None:
        """t averaged over the replicas in place: one all-reduce, timed into comm_seconds
        and counted in bytes_sent."""
        lap = start_lap(t.device)
        dist.all_reduce(t, group=self.group)
        self._comm.add(lap.stop())
        t.div_(world)
        self.bytes_sent += t.numel() * t.element_size()

    def stats(self) -> EDGCStats:
        """This process's counters: `step` counts inner steps, bytes are the outer syncs'
        (bytes_uncompressed: what DDP's all-reduce would have sent over the same inner
        steps), `state_bytes` what DiLoCo holds (θ, the momentum and the core's state),
        `comm_seconds` the outer syncs' time (the whole all-reduce, or the core's rounds and
        the prediction's coefficients); rank, phase and the other times are the compression
        core's (0, "warmup" and 0 without one)."""
        inner = self.sync.stats() if self.sync is not None else None
        fields = {k: getattr(inner, k) for k in EDGCStats.__dataclass_fields__} if inner is not None else {
            "phase": "warmup", "rank": 0, "step_phase": "warmup", "step_rank": 0, "entropy": math.nan,
            "min_rank": 0, "max_rank": 0, "compress_seconds": 0.0, "comm_seconds": 0.0, "entropy_seconds": 0.0,
            "nonfinite_steps": 0, "compressed_steps": 0}
        # (what DiLoCo holds besides the model: θ and the momentum, and the core's state)
        held = sum(g.numel() * g.element_size() for g in self.global_params)
        held += self.error.numel() * self.error.element_size() if self.error is not None else 0
        held += sum(m.numel() * m.element_size() for st in self.outer_optimizer.state.values()
                    for m in st.values() if isinstance(m, torch.Tensor))
        fields.update(step=self.step_count, bytes_sent=self.bytes_sent + (inner.bytes_sent if inner is not None else 0),
                      bytes_uncompressed=self.step_count * self._ddp_bytes,
                      comm_seconds=float(self._comm) + (inner.comm_seconds if inner is not None else 0.0),
                      state_bytes=held + (inner.state_bytes if inner is not None else 0))
        return EDGCStats(**fields)

    def state_dict(self) -> dict[str, Any]:
        """θ, the outer momentum, the step and the counters, the int4 wire's error feedback
        (this replica's; None on other wires), and the compression state (this replica's
        error feedback and Q) as bytes, on the CPU."""
        momentum = [self.outer_optimizer.state.get(g, {}).get("momentum_buffer") for g in self.global_params]
        comm = None
        if self.sync is not None:
            blob = io.BytesIO()
            torch.save(self.sync.state_dict(), blob)
            comm = blob.getvalue()
        return {"format": _FORMAT, "version": _VERSION, "inner_steps": self.inner_steps,
                "numel": self._numel, "step": self.step_count, "outer_steps": self.outer_steps,
                "bytes_sent": self.bytes_sent, "comm_seconds": float(self._comm),
                "global": [g.detach().cpu().clone() for g in self.global_params],
                "momentum": [None if m is None else m.detach().cpu().clone() for m in momentum],
                "error": None if self.error is None else self.error.cpu().clone(),
                "compression": comm}

    def load_state_dict(self, d: dict[str, Any], *, trust: bool = False) -> None:
        """Restore a state_dict() before the next step. Raises ValueError on another
        format, model size, H, or a compression state where there is none (or the
        reverse); an entry that names code to run is refused unless `trust`."""
        if not isinstance(d, dict) or d.get("format") != _FORMAT:
            raise ValueError(f"not a DiLoCo state (missing format marker {_FORMAT!r})")
        if int(d.get("version", 0)) > _VERSION:
            raise ValueError(f"DiLoCo state version {d['version']} is newer than this edgc reads ({_VERSION})")
        if int(d["numel"]) != self._numel or len(d["global"]) != len(self.global_params):
            raise ValueError(f"DiLoCo state was saved for a model of {d['numel']} parameters in {len(d['global'])} "
                             f"tensors; this one has {self._numel} in {len(self.global_params)}")
        if int(d["inner_steps"]) != self.inner_steps:
            raise ValueError(f"DiLoCo state was saved with inner_steps={d['inner_steps']}, this one has "
                             f"{self.inner_steps}: the outer steps would fall elsewhere")
        if (d["compression"] is None) != (self.sync is None):
            raise ValueError("DiLoCo state and this DiLoCo differ in compression (edgc-diloco against plain "
                             "DiLoCo): resume it as it was saved")
        error = d.get("error")  # (states of edgc before the int4 wire lack it)
        if (error is None) != (self.error is None):
            raise ValueError("DiLoCo state and this DiLoCo differ in where the error feedback is kept (the int4 "
                             "wire's, of all of the pseudo-gradient, against the core's): resume with the wire "
                             "and use_error_feedback it was saved with")
        if error is not None and tuple(error.shape) != (self._numel,):
            raise ValueError(f"DiLoCo state holds an error feedback of shape {tuple(error.shape)} for a model of "
                             f"{self._numel} parameters")
        for g, saved in zip(self.global_params, d["global"], strict=True):
            if tuple(saved.shape) != tuple(g.shape):
                raise ValueError(f"DiLoCo state holds a tensor of shape {tuple(saved.shape)} where this model has "
                                 f"{tuple(g.shape)}")
            g.copy_(saved)
        for g, m in zip(self.global_params, d["momentum"], strict=True):
            if m is not None:
                self.outer_optimizer.state[g]["momentum_buffer"] = m.to(g.device, g.dtype).clone()
        self.step_count, self.outer_steps = int(d["step"]), int(d["outer_steps"])
        self.bytes_sent = int(d["bytes_sent"])
        self._comm = LapSum(float(d.get("comm_seconds", 0.0)))  # (older states lack it)
        if self.error is not None:
            assert error is not None  # (checked above)
            self.error.copy_(error)
        if self.sync is not None:
            raw = d["compression"]
            data = raw.numpy().tobytes() if isinstance(raw, torch.Tensor) else raw
            self.sync.load_state_dict(load_torch(data, what="DiLoCo compression state",
                                                 how="load_state_dict(..., trust=True)", trust=trust))
