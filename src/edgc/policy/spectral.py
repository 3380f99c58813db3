"""The spectral rank policy (beyond the paper): one rank per group of same-shape matrices,
following the effective rank of what PowerSGD already transmits.

The signal. After a PowerSGD round P is orthonormal, so the approximation P Qᵀ has the
singular values of Q, and their squares are the eigenvalues λ of the r×r matrix QᵀQ. Q is
averaged over replicas before anyone looks at it, so every replica reads the same
spectrum. Its entropy gives the effective rank of the transmitted part,

    erank = exp(H(p)),   p_i = λ_i / Σλ,

which is r when all r directions carry equal energy and 1 when one direction carries it
all. It costs one (r×r) Gram product per matrix and a batched eigvalsh on sampled steps;
no gradient sample and no extra collective per step.

The rule. A group at rank r whose transmitted spectrum is nearly flat (erank close to r)
is cutting directions about as strong as those it keeps: it needs more rank. One whose
energy sits in a few directions (erank well below r) spends bytes on directions that carry
little. At each window end every group moves towards

    r ← headroom · mean erank over the window's sampled steps,

within a factor of two per window, outside a ±10% dead band, in [r_min, r_max]. The fixed point is where
erank / r = 1 / headroom: for a spectrum whose energy falls like i^-a, headroom 1.5 holds
rank 4 at a = 2, about 6 at a = 1.5 and about 16 at a = 1. Measured on the tiny GPT-2
(benchmarks/gradient_spectra.py, BENCHMARKS §8), gradients start near rank 1 and flatten
as training goes on, so the rank starts low and grows with them, per matrix type.

Pure python and torch arithmetic: nothing here calls torch.distributed.
"""

from __future__ import annotations

import math

import torch

__all__ = ["effective_ranks", "round_rank", "spectral_rank"]

#: Most a rank may grow or shrink (as a factor) in one window.
MAX_FACTOR = 2.0
#: A target within this relative distance of the rank keeps it (no flapping between neighbours).
DEAD_BAND = 0.1


def effective_ranks(q: torch.Tensor) -> torch.Tensor:
    """exp(entropy) of the normalised squared singular values of each (n, r) matrix in
    the batch `q` (B, n, r): a float64 tensor (B,), NaN where a matrix is all zero."""
    q = q.double()
    lam = torch.linalg.eigvalsh(q.transpose(-1, -2) @ q).clamp_min(0.0)  # (B, r)
    total = lam.sum(dim=-1, keepdim=True)
    p = lam / total
    entropy = -torch.special.xlogy(p, p).sum(dim=-1)
    return torch.where(total.squeeze(-1) > 0, entropy.exp(), torch.full_like(entropy, math.nan))


def round_rank(proposed: float, *, r_min: int, r_max: int, multiple: int) -> int:
    """`proposed` rounded to a multiple of `multiple` (whole ranks below one multiple, so a
    multiple of 4 does not round rank 2 down to 0), clipped to [max(r_min, 1), r_max]."""
    rounded = int(round(proposed / multiple)) * multiple if proposed >= multiple else int(round(proposed))
    return int(min(max(rounded, r_min, 1), r_max))


def spectral_rank(rank: int, erank: float, headroom: float, *, r_min: int, r_max: int, multiple: int) -> int:
    """The group's next rank from its window-mean effective rank `erank` at rank `rank`.

    The target is headroom · erank, moved at most a factor MAX_FACTOR from `rank`. Outside
    a dead band of ±DEAD_BAND around `rank` a growing target is rounded up and a shrinking
    one down (to a multiple of `multiple`; whole ranks below one multiple): rounding to
    the nearest would hold rank 2 for ever, since erank ≤ rank and 1.5 · erank < 3 rounds
    back to 2. Clipped to [max(r_min, 1), r_max]. A non-finite erank keeps the rank."""
    if not math.isfinite(erank) or erank <= 0:
        return rank
    target = headroom * erank
    if target > rank * (1.0 + DEAD_BAND):
        x = min(target, rank * MAX_FACTOR)
        proposed = math.ceil(x / multiple) * multiple if x >= multiple else math.ceil(x)
    elif target < rank * (1.0 - DEAD_BAND):
        x = max(target, rank / MAX_FACTOR)
        proposed = math.floor(x / multiple) * multiple if x >= multiple else math.floor(x)
    else:
        proposed = rank
    return int(min(max(proposed, r_min, 1), r_max))
