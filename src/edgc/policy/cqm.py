"""Compression Quantification Model (CQM): the paper's entropy-to-rank rule.

The paper's second component. By Eckart–Young–Mirsky the best rank-r approximation A_r of
an m×n matrix A has ‖A − A_r‖²_F = Σ_{i>r} λ_i, λ the eigenvalues of AAᵀ in decreasing
order. For a matrix with iid N(0, σ²) entries the paper writes the expected relative error
as ε = g(r; m, n), which does not depend on σ, and estimates it with the Marchenko–Pastur
(MP) law and with Monte-Carlo sampling. Both are here:

- "mp": with k = min(m, n), K = max(m, n) and y = k/K, the k eigenvalues of AAᵀ/(σ²K)
  follow the MP law with ratio y, so the top r of them are the upper r/k quantile of
  that law, and g(r)² is the share of the law's first moment below the (1 − r/k)
  quantile.
- "montecarlo": the exact singular values of a few seeded Gaussian matrices, averaged.

For Gaussian gradients σ ∝ e^H, so holding the absolute error σ·g(r) fixed from one
window to the next gives the paper's rule r₁ = g⁻¹(e^{H₀−H₁}·g(r₀)) (`cqm_rank`): when
entropy falls the error budget relative to σ grows and the rank drops.

Pure numpy/python; nothing here calls torch.distributed.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, ClassVar

import numpy as np

from edgc.policy.base import RankPolicy, Signals, WindowEnd
from edgc.policy.window import limit_rank

__all__ = ["METHODS", "CQMConfig", "CQMPolicy", "ErrorModel", "cqm_rank", "error_curve", "relative_error"]

#: Names accepted for `method`.
METHODS = ("mp", "montecarlo")

# Cells of the θ grid used to integrate the MP density (see `_mp_curve`). The midpoint
# rule on this grid puts the MP CDF within ~1e-9 of its closed form at y = 1 (checked in
# tests/unit/test_cqm.py against the y = 1 closed form), far below the ~1e-3 needed.
_MP_GRID_CELLS = 1 << 16


def _check_shape(m: int, n: int) -> tuple[int, int]:
    """Return (k, K) = (min(m, n), max(m, n)); raise ValueError unless m, n >= 1."""
    if int(m) != m or int(n) != n or m < 1 or n < 1:
        raise ValueError(f"matrix shape must be two positive integers, got ({m!r}, {n!r})")
    m, n = int(m), int(n)
    return min(m, n), max(m, n)


def _check_method(method: str) -> None:
    """Raise ValueError unless `method` is one of METHODS."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")


@lru_cache(maxsize=256)
def _mp_curve(k: int, big_k: int) -> np.ndarray:
    """Return g(0..k) for a k×K Gaussian matrix (k <= K) from the Marchenko–Pastur law.

    With y = k/K the law has support [a, b] = [(1−√y)², (1+√y)²] and density
    f(x) = √((b−x)(x−a)) / (2π·y·x), mean 1. Substituting x = a + (b−a)(1−cos θ)/2,
    θ ∈ [0, π], turns the two integrals we need into smooth ones:

    - CDF:  dF = ((b−a)/2)²·sin²θ / (2π·y·x(θ)) dθ, integrated by the midpoint rule.
      At y = 1 (a = 0) the 1/√x singularity of f at 0 cancels against sin²θ, so the
      integrand stays bounded (it is b·cos²(θ/2)/(2π)).
    - first moment: x·f(x) dx = ((b−a)/2)²·sin²θ / (2π·y) dθ, whose integral from 0 is
      (θ − sin θ·cos θ)/π after normalising by the total (the mean, 1).

    g(r)² is the first moment below the quantile q with F(q) = 1 − r/k. The result is a
    read-only float64 array of length k + 1, strictly decreasing from 1 to 0.
    """
    if k == 1:
        return _read_only(np.array([1.0, 0.0]))
    y = k / big_k
    a = (1.0 - math.sqrt(y)) ** 2
    b = (1.0 + math.sqrt(y)) ** 2
    h = math.pi / _MP_GRID_CELLS
    theta_mid = (np.arange(_MP_GRID_CELLS) + 0.5) * h  # (cells,)
    half_width = (b - a) / 2.0
    u = 2.0 * np.sin(theta_mid / 2.0) ** 2  # 1 − cos θ without cancellation near θ = 0
    x = a + half_width * u
    density = half_width**2 * np.sin(theta_mid) ** 2 / (2.0 * math.pi * y * x)  # dF/dθ
    cdf = np.concatenate(([0.0], np.cumsum(density) * h))  # (cells + 1,) at the cell edges
    cdf /= cdf[-1]  # the total is 1 up to the rule's error; normalise it away
    theta_edges = np.arange(_MP_GRID_CELLS + 1) * h
    targets = 1.0 - np.arange(k + 1) / k  # F(q_r) = 1 − r/k, r = 0..k
    theta_r = np.interp(targets, cdf, theta_edges)
    moment_below = (theta_r - np.sin(theta_r) * np.cos(theta_r)) / math.pi
    curve = np.sqrt(np.clip(moment_below, 0.0, 1.0))
    curve[0], curve[-1] = 1.0, 0.0  # exact endpoints: full energy at r = 0, none at r = k
    return _read_only(curve)


@lru_cache(maxsize=64)
def _montecarlo_curve(k: int, big_k: int, samples: int, seed: int) -> np.ndarray:
    """Return g(0..k) for a k×K Gaussian matrix, averaged over `samples` seeded draws.

    Each draw is a k×K float64 matrix of iid N(0, 1) entries from
    `numpy.random.default_rng(seed)`; its eigenvalues λ = s² (s the singular values) are
    averaged over draws, and g(r) = sqrt(Σ_{i>r} E λ_i / Σ_i E λ_i). The result is a
    read-only float64 array of length k + 1. This is exact but costs `samples` SVDs, so
    it is meant for checks, not for the largest shapes.
    """
    rng = np.random.default_rng(seed)
    mean_eigs = np.zeros(k)
    for _ in range(samples):
        s = np.linalg.svd(rng.standard_normal((k, big_k)), compute_uv=False)  # (k,), descending
        mean_eigs += s**2
    mean_eigs /= samples
    # tail[r] = Σ_{i >= r} λ_i (0-based), the energy the best rank-r approximation leaves.
    tail = np.concatenate((np.cumsum(mean_eigs[::-1])[::-1], [0.0]))  # (k + 1,)
    curve = np.sqrt(tail / tail[0])
    curve[0], curve[-1] = 1.0, 0.0
    return _read_only(curve)


def _read_only(a: np.ndarray) -> np.ndarray:
    """Return `a` marked read-only, so a cached array cannot be changed by a caller."""
    a.flags.writeable = False
    return a


def error_curve(m: int, n: int, method: str = "mp", samples: int = 4, seed: int = 0) -> np.ndarray:
    """Return g(r; m, n) for r = 0..min(m, n) as a read-only float64 array.

    g is the expected relative Frobenius error of the best rank-r approximation of an m×n
    matrix with iid Gaussian entries: 1 at r = 0, 0 at r = min(m, n), strictly decreasing
    in between, and the same for m×n and n×m. `samples` and `seed` apply to "montecarlo"
    only. Computed once per shape and method and cached.
    """
    _check_method(method)
    k, big_k = _check_shape(m, n)
    if method == "mp":
        return _mp_curve(k, big_k)
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples!r}")
    return _montecarlo_curve(k, big_k, int(samples), int(seed))


def relative_error(r: int, m: int, n: int, method: str = "mp", samples: int = 4, seed: int = 0) -> float:
    """Return g(r; m, n), the expected relative error of a rank-r approximation.

    g(r) = sqrt(E Σ_{i>r} λ_i / E Σ_i λ_i) for an m×n matrix with iid Gaussian entries, λ
    the eigenvalues of AAᵀ. Ranks at or above min(m, n) give 0.0. Raises ValueError for a
    negative rank. See `error_curve` for the methods.
    """
    if r < 0 or int(r) != r:
        raise ValueError(f"rank must be a non-negative integer, got {r!r}")
    curve = error_curve(m, n, method=method, samples=samples, seed=seed)
    return float(curve[min(int(r), len(curve) - 1)])


class ErrorModel:
    """The expected relative error of compressing a set of matrices at one common rank.

    Built from the shapes of the matrices the compressor handles. For iid entries the
    expected energy of a matrix is proportional to its element count, so the aggregate
    squared error weights each matrix's g² by m·n:

        g(r) = sqrt( Σ_i m_i·n_i·g_i(r)² / Σ_i m_i·n_i )

    A matrix with min(m_i, n_i) <= r contributes no error. The table g(0..max_rank) is
    computed once, where max_rank is the largest min(m_i, n_i); between integer ranks g is
    linear, and `g_inv` inverts that piecewise-linear g exactly.
    """

    def __init__(
        self,
        shapes: Iterable[tuple[int, int]],
        method: str = "mp",
        samples: int = 4,
        seed: int = 0,
    ) -> None:
        _check_method(method)
        self.shapes: tuple[tuple[int, int], ...] = tuple((int(m), int(n)) for m, n in shapes)
        if not self.shapes:
            raise ValueError("ErrorModel needs at least one matrix shape")
        self.method = method
        counts = Counter(self.shapes)  # repeated layers share one curve
        self.max_rank: int = max(_check_shape(m, n)[0] for m, n in counts)
        weighted_sq = np.zeros(self.max_rank + 1)  # (max_rank + 1,)
        total_weight = 0
        for (m, n), count in counts.items():
            curve = error_curve(m, n, method=method, samples=samples, seed=seed)  # (k_i + 1,)
            weight = count * m * n
            weighted_sq[: len(curve)] += weight * curve**2  # ranks beyond k_i add 0
            total_weight += weight
        self._ranks = np.arange(self.max_rank + 1, dtype=np.float64)
        self._table = _read_only(np.sqrt(weighted_sq / total_weight))

    def __repr__(self) -> str:
        return f"ErrorModel({len(self.shapes)} matrices, max_rank={self.max_rank}, method={self.method!r})"

    @property
    def table(self) -> np.ndarray:
        """The read-only table g(0..max_rank)."""
        return self._table

    def g(self, r: float) -> float:
        """Return the aggregate expected relative error at (continuous) rank r.

        Linear between integer ranks; 1.0 at r = 0 and 0.0 for r >= max_rank. Raises
        ValueError for a negative or non-finite r.
        """
        r = float(r)
        if not math.isfinite(r) or r < 0.0:
            raise ValueError(f"rank must be finite and >= 0, got {r!r}")
        return float(np.interp(r, self._ranks, self._table))

    def g_inv(self, eps: float) -> float:
        """Return the continuous rank r in [0, max_rank] with g(r) = eps.

        eps >= 1 gives 0.0 and eps <= 0 gives max_rank. The table is strictly decreasing
        (the largest matrix's curve is, and the others do not increase), so the inverse of
        the piecewise-linear g is unique. Raises ValueError for nan.
        """
        eps = float(eps)
        if math.isnan(eps):
            raise ValueError("error target must not be nan")
        if eps >= 1.0:
            return 0.0
        if eps <= 0.0:
            return float(self.max_rank)
        # np.interp needs increasing x, so read the decreasing table backwards.
        return float(np.interp(eps, self._table[::-1], self._ranks[::-1]))


def cqm_rank(h_prev: float, h_cur: float, r_prev: float, model: ErrorModel) -> float:
    """Return the paper's next rank r₁ = g⁻¹(e^{H₀−H₁}·g(r₀)) as a continuous value.

    h_prev = H₀ and r_prev = r₀ are the previous window's mean entropy and rank, h_cur =
    H₁ the current window's. Falling entropy gives a lower rank, rising entropy a higher
    one, equal entropy the same rank. The result lies in [0, model.max_rank]; rounding
    and clipping to [r_min, r_max] are the caller's. If either entropy is not finite,
    r_prev is returned unchanged. Note that r₀ >= max_rank (zero error) always maps to
    max_rank, since no factor scales a zero error.
    """
    if not (math.isfinite(h_prev) and math.isfinite(h_cur)):
        return r_prev
    delta = h_prev - h_cur
    # e^delta overflows a float above ~709; any such factor already pushes eps past 1.
    factor = math.exp(delta) if delta < 700.0 else math.inf
    g_prev = model.g(r_prev)
    eps = g_prev * factor if g_prev > 0.0 else 0.0  # avoid 0·inf = nan
    return model.g_inv(eps)


@dataclass(kw_only=True)
class CQMConfig:
    """The "cqm" policy's parameters (EDGCConfig.cqm)."""

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"method": METHODS}

    method: str = "mp"
    """How g(r; m, n) is computed: "mp" (the Marchenko-Pastur law) or "montecarlo" (exact
    SVDs of sampled Gaussian matrices)."""

    smoothing: float = 0.0
    """In [0, 1): the rule compares exponential moving averages of the window mean
    entropies, each window weighing 1 - smoothing (0: the raw means, as the paper). A
    window mean of few samples is noisy next to the entropy change the whole rank range
    spans; smoothing keeps the rule from following that noise."""

    def check(self, bad: Callable[[str, str], None]) -> None:
        """Call `bad(field, why)` for the first field out of its range."""
        if not 0.0 <= self.smoothing < 1.0:
            bad("smoothing", "must be in [0, 1)")


class CQMPolicy(RankPolicy):
    """The paper's rule: r1 = g^-1(e^(H0 - H1) g(r0)) from the last two compared window
    means (`cqm_rank`), moved by at most `rank_step` per window.

    The rank is kept as a continuous value between windows (`rank_value`), so that a slow
    drift of entropy, each window's move smaller than one rounding step, still adds up;
    the rank in use is that value rounded to `rank_multiple`. The CQM assumes roughly
    normal gradients, so windows that hold warm-up steps (the skewed, unstable phase the
    warm-up exists to skip) are not compared: only windows from `first_window` on."""

    signals = Signals(entropy=True)

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.method: str = config.cqm.method
        self.smoothing: float = config.cqm.smoothing
        self.rank_value = 0.0  # the continuous rank behind `rank`
        self.first_window = 0  # the first window compared (index into the history)
        self.error_model: ErrorModel | None = None

    def start(self, r_min: int, r_max: int, *, step: int, windows_closed: int, mid_window: bool) -> int:
        self.rank_value = float(r_max)
        self.first_window = windows_closed + (1 if mid_window else 0)
        return super().start(r_min, r_max, step=step, windows_closed=windows_closed, mid_window=mid_window)

    def bind_shapes(self, shapes: Sequence[tuple[int, int]]) -> None:
        self.error_model = ErrorModel(shapes, method=self.method)

    def compared(self, history: Sequence[float]) -> list[float]:
        """The window means the rule compares: the finite ones from `first_window` on,
        exponentially smoothed when `smoothing` > 0."""
        finite = [h for h in history[self.first_window :] if math.isfinite(h)]
        if self.smoothing <= 0.0 or not finite:
            return finite
        out = [finite[0]]
        for h in finite[1:]:
            out.append(self.smoothing * out[-1] + (1.0 - self.smoothing) * h)
        return out

    def decide(self, end: WindowEnd) -> int | None:
        if not end.compressing:
            return None
        compared = self.compared(end.history)
        if not (end.history and math.isfinite(end.history[-1])) or len(compared) < 2:
            return self.rank
        assert self.error_model is not None, "cqm needs the matrices' shapes (bind_shapes)"
        proposed = cqm_rank(compared[-2], compared[-1], self.rank_value, self.error_model)
        if math.isfinite(proposed):  # the rate limit and the bounds act on the continuous value
            value = min(max(proposed, self.rank_value - self.rank_step), self.rank_value + self.rank_step)
            self.rank_value = min(max(value, float(end.r_min)), float(end.r_max))
        self.rank = limit_rank(self.rank_value, self.rank, r_min=end.r_min, r_max=end.r_max, step=None,
                               multiple=self.rank_multiple)
        return self.rank

    def state_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "rank_value": self.rank_value, "first_window": self.first_window}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.rank = int(d["rank"])
        self.rank_value = float(d["rank_value"])
        self.first_window = int(d["first_window"])

    @classmethod
    def state_from_v1(cls, v1: dict[str, Any]) -> dict[str, Any]:
        controller = v1["controller"]  # (states before rank_value existed: the rounded rank)
        return {"rank": int(controller["rank"]), "rank_value": float(controller.get("rank_value", controller["rank"])),
                "first_window": int(controller["first_window"])}
