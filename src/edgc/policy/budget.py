"""The error-budget rank policy (beyond the paper): one rank per group of same-shape matrices.

Why not one global scalar. Measured on the tiny GPT-2 (benchmarks/gradient_spectra.py,
BENCHMARKS §8), the gradient matrices differ in how low-rank they are: at step 300 the
token embedding's gradient keeps 84% of its energy at rank 16, the attention matrices
97-99%, and all of them are close to rank 1 in the first tens of steps. A single rank
sized for the hardest matrix overpays for the others, and an entropy averaged over all of
them cannot tell which is which.

The rule. PowerSGD already measures what it keeps: with P orthonormal, ‖PᵀM‖² = ‖Q‖²
is the energy of M (gradient plus error feedback) inside the transmitted subspace, so the
share left out is ρ = 1 − ‖Q‖²/‖M‖². Summed over a window and over replicas (so every
replica sees the same number), ρ_g of each group is steered towards the budget τ:

    r_g ← r_g · clip((ρ_g / τ)^κ, 1/2, 2),   rounded, in [r_min, r_max]

κ = 0.7 inverts a residual that falls like r^(-1/κ) (the measured spectra fall like
r^(-1.2) to r^(-1.8) between ranks 4 and 16), and the clip keeps a move within a factor
of two per window. A group that keeps more than its budget gives rank back; one that
keeps less gets more. Pure python: nothing here calls torch.distributed.
"""

from __future__ import annotations

import math

from edgc.policy.spectral import round_rank

__all__ = ["budget_rank", "equivalent_rank"]

#: Exponent of the correction (see module doc).
KAPPA = 0.7
#: Most a rank may grow or shrink (as a factor) in one window.
MAX_FACTOR = 2.0


def budget_rank(rank: int, left_out: float, budget: float, *, r_min: int, r_max: int, multiple: int) -> int:
    """The group's next rank: `rank` scaled towards leaving out `budget` of its energy,
    given that it left out `left_out` (window share, in [0, 1]). Non-finite input keeps
    the rank. The result is a multiple of `multiple` (a whole rank below one multiple)
    in [r_min, r_max]."""
    if not (math.isfinite(left_out) and budget > 0):
        return rank
    left_out = min(max(left_out, 1e-6), 1.0)  # (a perfect fit still shrinks, by at most the clip)
    factor = min(max((left_out / budget) ** KAPPA, 1.0 / MAX_FACTOR), MAX_FACTOR)
    return round_rank(rank * factor, r_min=r_min, r_max=r_max, multiple=multiple)


def equivalent_rank(ranks: list[int], costs: list[int]) -> float:
    """The uniform rank that would send the same bytes: Σ cost·r / Σ cost, where a group's
    cost is the elements one rank of it sends (Σ over its matrices of m + n)."""
    total = sum(costs)
    return sum(r * c for r, c in zip(ranks, costs, strict=True)) / total if total else 0.0
