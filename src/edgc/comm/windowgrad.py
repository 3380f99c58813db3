"""WindowGradient: the signals EDGCState reads from the averaged gradient over a window.

What it reads. After a step's sync every replica holds the same averaged gradient, the
one DDP hands to the optimiser (bit for bit: it is the result of the same all-reduces, and
on a compressed step the same reconstruction P Q^T from them). So anything computed from
it agrees across replicas with no collective of its own:

- For the "critical" policy (edgc.policy.critical): the window's sum of the averaged
  gradient, on the GDS sample of its elements (every round(1/beta)-th element of each
  tensor, at CompressionState.sample_layout's offsets), in float64 on the gradients' device.
  At the window end N = ||sum / steps||, the norm of the window's mean gradient on those
  elements. With error feedback, the compressed steps' averages add up over a window to
  roughly the true gradients' sum (what a step leaves out is sent in later steps).
  Memory: beta of one gradient, in float64, plus a transient sample per step.
- For the noise scale (edgc.policy.critical.noise_scale), on sampled steps: |G_big|^2, the
  squared norm of the averaged gradient's sample, beside |G_small|^2, the replicas' mean
  squared norm of their own gradient's sample, which travels in the step's control
  all-reduce (edgc.comm.step, GRAD_SQ). Both are summed over the window and divided at
  its end, as McCandlish et al. advise. On the same sampled elements, the sampling factor
  cancels in the ratio. On a compressed step the average is the low-rank reconstruction,
  not the true mean gradient: |G_big|^2 then lacks what the rank left out, and the noise
  scale reads high (biased); warm-up steps measure it unbiased.

Steps whose average is not finite are left out (a device flag, no host read): the
optimiser skips them too. The sums stay on the device; the host reads them once per window.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from edgc.entropy import sample_into

__all__ = ["WindowGradient"]


class WindowGradient:
    """Sums of the averaged gradient's sample over the open window (see module doc)."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None  # (S,) float64: Σ of the sampled average, unscaled
        self.steps: torch.Tensor | None = None  # () float64: finite steps in `total`
        self.noise: torch.Tensor | None = None  # (2,) float64: Σ |G_small|², Σ |G_big|² of sampled steps

    @property
    def nbytes(self) -> int:
        """The bytes the window's sums hold."""
        return sum(t.untyped_storage().nbytes() for t in (self.total, self.steps, self.noise) if t is not None)

    def observe(self, grads: Sequence[torch.Tensor], offsets: Sequence[int], dtype: torch.dtype, rate: float,
                scale: float, finite: torch.Tensor, *, accumulate: bool, small_sq: float | None,
                sample: torch.Tensor | None = None) -> None:
        """Add one step's averaged gradient `grads` (slot order, in units of `scale`, the
        loss scale) to the window: its sample to `total` when `accumulate`, and with
        `small_sq` (|G_small|^2 agreed over replicas; None: not measured this step) both
        squared norms to `noise`. `finite` (a device bool) says whether the step's sums were
        finite; the sample is checked too. `sample`: the average's sample taken already (an
        eager synchroniser takes it buffer by buffer), used instead of sampling `grads`; it
        is changed in place. Changes nothing when neither is asked for."""
        if not accumulate and small_sq is None:
            return
        device = grads[0].device
        if sample is None:
            sample = torch.empty(offsets[-1], dtype=dtype, device=device)  # (S,)
            for g, (start, end) in zip(grads, itertools.pairwise(offsets), strict=True):
                sample_into(sample[start:end], g, rate)
        if scale != 1.0:
            sample.div_(scale)
        ok = finite & torch.isfinite(sample).all()  # (on the device)
        sample.masked_fill_(~ok, 0.0)
        if accumulate:
            if self.total is None or self.steps is None or self.total.numel() != sample.numel():
                self.total = torch.zeros(sample.numel(), dtype=torch.float64, device=device)
                self.steps = torch.zeros((), dtype=torch.float64, device=device)
            self.total = self.total.to(device)
            self.steps = self.steps.to(device)
            self.total.add_(sample)
            self.steps.add_(ok.double())
        if small_sq is not None:
            big_sq = torch.linalg.vector_norm(sample, dtype=torch.float64).square()
            both = torch.stack([torch.tensor(small_sq, dtype=torch.float64, device=device), big_sq])
            both.masked_fill_(~ok, 0.0)
            self.noise = both if self.noise is None else self.noise.to(device) + both

    def close(self, agree: Callable[[torch.Tensor], None] | None = None) -> tuple[float, tuple[float, float] | None]:
        """End the window: returns (N, the norm of its mean sampled gradient, nan without
        finite steps or sums; (Σ |G_small|², Σ |G_big|²) or None without sampled steps),
        and starts the next window empty. One host read.

        `agree`: where each process holds only a part of the gradient (a shard, under
        HSDP), a function that averages a float64 CPU vector in place over every process
        that must decide alike. The squared norms and counts are then averaged before the
        division, so every shard reads the same N and noise scale (each a ratio or a norm
        in which the shards' common factor cancels or is shared)."""
        norm, noise = math.nan, None
        values = []
        if self.total is not None and self.steps is not None:
            total = torch.linalg.vector_norm(self.total)
            values += [total.square() if agree is not None else total, self.steps]
        if self.noise is not None:
            # (a state loaded just before a window end may still hold it on the CPU)
            values += [*self.noise.to(values[0].device if values else self.noise.device)]
        read = torch.stack(values).tolist() if values else []
        if agree is not None and read:
            agreed = torch.tensor(read, dtype=torch.float64)
            agree(agreed)
            read = agreed.tolist()
            if self.total is not None:
                read[0] = math.sqrt(max(read[0], 0.0))
        if self.total is not None and self.steps is not None:
            total_norm, steps = read[:2]
            norm = total_norm / steps if steps > 0 else math.nan
            read = read[2:]
            self.total.zero_()
            self.steps.zero_()
        if self.noise is not None:
            noise = (read[0], read[1])
            self.noise = None
        return norm, noise

    def state_dict(self) -> dict[str, Any]:
        def cpu(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.detach().cpu().clone()

        return {"total": cpu(self.total), "steps": cpu(self.steps), "noise": cpu(self.noise)}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore (CPU tensors; moved to the gradients' device at the next step)."""
        def f64(t: Any) -> torch.Tensor | None:
            return None if t is None else torch.as_tensor(t, dtype=torch.float64).clone()

        self.total, self.steps, self.noise = f64(d["total"]), f64(d["steps"]), f64(d["noise"])
