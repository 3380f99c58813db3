"""Gradient Data Sampler (GDS): sampling a gradient and estimating its entropy.

EDGC follows the entropy of the gradient (the paper's first component; docs/method.md). Measuring it on
every step over every element would cost as much as a pass over the whole gradient, so
the GDS samples at two levels:

- iteration sampling rate α: entropy is measured only every round(1/α) steps
  (`is_sampled_step`);
- gradient sampling rate β: only every round(1/β)-th element of each flattened tensor
  is used (`sample_gradient`); the released code takes every 4th element at β = 0.25.

Two estimators are offered:

- "histogram": the released estimator, Shannon entropy (natural log) of a 1000-bin
  `torch.histc` histogram over [min, max] of the finite values. Its discrete form
  −Σ p log p does not move when the gradient is scaled; the differential form adds
  log(bin width) and so shifts by log c when the gradient is scaled by c, which is the
  link between entropy and σ that the paper's CQM relies on. The differential form is
  the default here.
- "gaussian": ½·log(2πe·σ²), the entropy of a normal with the sample's σ.

Nothing here calls torch.distributed; this module runs inside a communication hook,
so every estimator makes one or two passes over the sample and no full-size copies.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

__all__ = [
    "ESTIMATORS",
    "estimate_entropy",
    "gaussian_entropy",
    "histogram_entropy",
    "is_sampled_step",
    "sample_gradient",
    "sample_into",
    "sample_offsets",
    "sample_stride",
]

#: Names accepted by `estimate_entropy` (the config field `entropy_estimator`).
ESTIMATORS = ("histogram", "gaussian")

# ½·log(2πe): the entropy of a unit normal, in nats.
_HALF_LOG_2PI_E = 0.5 * math.log(2.0 * math.pi * math.e)


def sample_stride(rate: float) -> int:
    """Return the stride k = max(1, round(1/rate)) that realises a sampling rate.

    Used for both levels of the GDS: every k-th element (β) and every k-th step (α).
    Raises ValueError unless 0 < rate <= 1.
    """
    rate_f = float(rate)
    if not (math.isfinite(rate_f) and 0.0 < rate_f <= 1.0):
        raise ValueError(f"sampling rate must be in (0, 1], got {rate!r}")
    return max(1, round(1.0 / rate_f))


def _working_dtype(dtype: torch.dtype) -> torch.dtype:
    """Return the dtype entropy is computed in: float64 stays float64, all else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def sample_offsets(numels: Sequence[int], rate: float) -> list[int]:
    """Return where each tensor's sample starts in `sample_gradient`'s output, and its end:
    len(numels) + 1 offsets, tensor i's ceil(N_i / k) elements lying between offsets i and
    i + 1 (k = `sample_stride(rate)`). Lets tensors that arrive one at a time be sampled
    into one buffer (`sample_into`) that equals `sample_gradient` of them all."""
    k = sample_stride(rate)
    offsets = [0]
    for n in numels:
        offsets.append(offsets[-1] + (int(n) + k - 1) // k)  # ceil(N / k) per tensor
    return offsets


def sample_into(out: torch.Tensor, tensor: torch.Tensor, rate: float) -> None:
    """Write every k-th element of the flattened `tensor` into `out` (ceil(N / k) elements,
    converted to out's dtype); the tensor is not changed. An empty `out` takes nothing: a
    tensor left out of the sample (CompressionState.uncounted)."""
    if out.numel() == 0:
        return
    # copy_ both gathers the strided view and converts the dtype in one pass.
    out.copy_(tensor.detach().reshape(-1)[:: sample_stride(rate)])


def sample_gradient(tensors: Sequence[torch.Tensor], rate: float) -> torch.Tensor:
    """Return every k-th element of each flattened tensor, concatenated (GSR β sampling).

    k = `sample_stride(rate)`; each tensor is sampled from its own element 0, so a tensor
    of N elements contributes ceil(N / k) of them. The result is a new 1-D tensor on the
    first tensor's device, float64 if any input is float64 and float32 otherwise (bf16 and
    fp16 gradients are widened). Only the sampled elements are copied: each tensor is read
    through a strided view `t.reshape(-1)[::k]`, which is a view for contiguous tensors.
    The inputs are not changed. An empty sequence gives an empty float32 tensor.
    """
    if len(tensors) == 0:
        sample_stride(rate)  # (the rate is checked all the same)
        return torch.empty(0, dtype=torch.float32)
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    offsets = sample_offsets([t.numel() for t in tensors], rate)
    out = torch.empty(offsets[-1], dtype=dtype, device=tensors[0].device)  # (Σ ceil(N_i/k),)
    for t, (start, end) in zip(tensors, itertools.pairwise(offsets), strict=True):
        sample_into(out[start:end], t, rate)
    return out


def is_sampled_step(step: int, rate: float) -> bool:
    """Return whether entropy is measured at `step` under iteration sampling rate α = `rate`.

    Steps count from 1, and the sampled steps are k, 2k, 3k, ... with k =
    `sample_stride(rate)`; with α = 1 every step is sampled. (Step 0, if a caller uses
    it, is a multiple of k and so counts as sampled.)
    """
    k = sample_stride(rate)
    return step % k == 0


def _finite_values(x: torch.Tensor) -> tuple[torch.Tensor, float, float]:
    """Return (finite values of x as a flat tensor, their min, their max).

    x is flattened and cast to the working dtype. When min and max are both finite, every
    value is finite (NaN propagates through aminmax and ±inf would be an extreme), and x is
    returned without the copy that boolean masking makes. With no finite values the
    returned tensor is empty and min = max = nan.
    """
    x = x.detach().reshape(-1)
    x = x.to(_working_dtype(x.dtype))
    if x.numel() == 0:
        return x, math.nan, math.nan
    lo, hi = (float(v) for v in torch.aminmax(x))
    if math.isfinite(lo) and math.isfinite(hi):
        return x, lo, hi
    x = x[torch.isfinite(x)]  # rare path: drop nan and ±inf
    if x.numel() == 0:
        return x, math.nan, math.nan
    lo, hi = (float(v) for v in torch.aminmax(x))
    return x, lo, hi


def histogram_entropy(x: torch.Tensor, bins: int = 1000, differential: bool = True) -> float:
    """Return the Shannon entropy (nats) of a `bins`-bin histogram of the finite values of x.

    The histogram is `torch.histc` over [min, max] of the finite values (non-finite values
    are dropped), computed in float32, or float64 for float64 input. With p the bin
    frequencies:

    - discrete form (`differential=False`): −Σ p log p, the released code's estimator; it
      is unchanged when x is scaled. A constant sample gives 0.0.
    - differential form (the default): −Σ p log p + log((max − min) / bins), which
      approximates the differential entropy of the values' density and shifts by log c
      when x is scaled by c. A constant sample gives nan (the bin width is 0).

    Returns nan when x has no finite values. x is not changed. The default of 1000 bins
    is the released code's.
    """
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins!r}")
    values, lo, hi = _finite_values(x)
    n = values.numel()
    if n == 0:
        return math.nan
    if hi == lo:
        return math.nan if differential else 0.0
    counts = torch.histc(values, bins=bins, min=lo, max=hi)  # (bins,)
    # The bins are few, so the sum is done in float64 whatever the sample's dtype.
    p = counts.to(torch.float64) / n
    p = p[p > 0]
    entropy = float(-(p * torch.log(p)).sum())
    if differential:
        entropy += math.log((hi - lo) / bins)
    return entropy


def gaussian_entropy(x: torch.Tensor) -> float:
    """Return ½·log(2πe·σ²) in nats, σ the (unbiased) standard deviation of x's finite values.

    This is the entropy of a normal with the same σ, so it shifts by exactly log c when x
    is scaled by c. Returns nan with fewer than 2 finite values or when σ == 0. x is not
    changed.
    """
    values, _, _ = _finite_values(x)
    if values.numel() < 2:
        return math.nan
    sigma = float(values.std())
    if not sigma > 0.0 or not math.isfinite(sigma):
        return math.nan
    return math.log(sigma) + _HALF_LOG_2PI_E


def estimate_entropy(
    x: torch.Tensor,
    estimator: str = "histogram",
    bins: int = 1000,
    differential: bool = True,
) -> float:
    """Return the entropy of x by the named estimator ("histogram" or "gaussian").

    `bins` and `differential` apply to "histogram" only. Raises ValueError naming the
    config field `entropy_estimator` for any other name. x is not changed.
    """
    if estimator == "histogram":
        return histogram_entropy(x, bins=bins, differential=differential)
    if estimator == "gaussian":
        return gaussian_entropy(x)
    raise ValueError(f"entropy_estimator must be one of {ESTIMATORS}, got {estimator!r}")
