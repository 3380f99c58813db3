"""Tests for edgc.policy.cqm: the error model g(r; m, n) and the paper's rank rule.

Random matrices come from local numpy/torch generators; the global RNGs are untouched.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

from edgc.entropy import gaussian_entropy, histogram_entropy
from edgc.policy.cqm import ErrorModel, cqm_rank, error_curve, relative_error

METHODS = ["mp", "montecarlo"]
SHAPES = [(64, 256), (256, 64), (128, 128), (3, 7), (1, 50), (50, 1)]


def _truncation_error(a: np.ndarray, r: int) -> float:
    """‖A − A_r‖_F of the best rank-r approximation, built from the SVD."""
    u, s, vt = np.linalg.svd(a, full_matrices=False)
    a_r = (u[:, :r] * s[:r]) @ vt[:r]
    return float(np.linalg.norm(a - a_r))


# --- g(r; m, n) ---------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", SHAPES)
def test_curve_endpoints_and_strictly_decreasing(method: str, shape: tuple[int, int]) -> None:
    m, n = shape
    k = min(m, n)
    curve = error_curve(m, n, method=method)
    assert curve.shape == (k + 1,)
    assert curve[0] == 1.0 and curve[-1] == 0.0
    assert np.all(np.diff(curve) < 0)
    assert relative_error(0, m, n, method=method) == 1.0
    assert relative_error(k, m, n, method=method) == 0.0
    assert relative_error(k + 5, m, n, method=method) == 0.0


@pytest.mark.parametrize("method", METHODS)
def test_vector_needs_rank_one(method: str) -> None:
    # A 1×n (or m×1) matrix has rank 1: nothing is kept at r = 0, everything at r = 1.
    for m, n in [(1, 20), (20, 1), (1, 1)]:
        assert relative_error(0, m, n, method=method) == 1.0
        assert relative_error(1, m, n, method=method) == 0.0


@pytest.mark.parametrize("method", METHODS)
def test_curve_is_symmetric_in_shape(method: str) -> None:
    assert np.array_equal(error_curve(64, 256, method=method), error_curve(256, 64, method=method))


@pytest.mark.parametrize("shape", [(64, 256), (128, 128)])
def test_marchenko_pastur_agrees_with_monte_carlo(shape: tuple[int, int]) -> None:
    m, n = shape
    k = min(m, n)
    for r in (k // 8, k // 4, k // 2, 3 * k // 4):
        mp = relative_error(r, m, n, method="mp")
        mc = relative_error(r, m, n, method="montecarlo", samples=4, seed=0)
        assert mp == pytest.approx(mc, abs=0.03), f"r={r}"


def test_marchenko_pastur_square_matches_closed_form() -> None:
    # At y = 1 the MP law has a 1/√x singularity at 0. Its CDF has a closed form in the
    # angle of x = 2(1 − cos θ): F = (θ + sin θ)/π, and the first moment below x is
    # (θ − sin θ cos θ)/π. So g(r)² = (θ − sin θ cos θ)/π where (θ + sin θ)/π = 1 − r/k.
    k = 512
    curve = error_curve(k, k, method="mp")
    for r in (1, 5, 64, 256, 400, 511):
        target = 1.0 - r / k
        lo, hi = 0.0, math.pi
        for _ in range(100):  # bisection on the monotone F(θ)
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if (mid + math.sin(mid)) / math.pi < target else (lo, mid)
        theta = 0.5 * (lo + hi)
        exact = math.sqrt((theta - math.sin(theta) * math.cos(theta)) / math.pi)
        assert curve[r] == pytest.approx(exact, abs=1e-6), f"r={r}"


def test_marchenko_pastur_is_continuous_in_aspect_ratio_near_square() -> None:
    # y just below 1 (a tiny positive lower edge) must not behave differently from y = 1.
    assert np.max(np.abs(error_curve(1000, 1000) - error_curve(1000, 1001))) < 1e-3


def test_monte_carlo_single_sample_is_exact_eckart_young() -> None:
    # With one sample, g(r)² is exactly the truncation error energy of that very matrix.
    m, n, seed = 12, 20, 7
    a = np.random.default_rng(seed).standard_normal((m, n))  # the same draw the method makes
    curve = error_curve(m, n, method="montecarlo", samples=1, seed=seed)
    total = float(np.linalg.norm(a))
    for r in range(m + 1):
        assert curve[r] == pytest.approx(_truncation_error(a, r) / total, abs=1e-12)


def test_mp_curve_for_paper_scale_shape_is_fast_and_cached() -> None:
    # GPT2-12.1B hidden size 3584 (the paper's reported setup); its MLP matrix is 3584×14336.
    from edgc.policy import cqm

    cqm._mp_curve.cache_clear()
    start = time.perf_counter()
    curve = error_curve(3584, 14336)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0
    assert curve.shape == (3585,)
    assert error_curve(14336, 3584) is curve  # cached, whichever way round
    with pytest.raises(ValueError):
        curve[1] = 0.5  # the cached table is read-only


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="method"):
        error_curve(4, 4, method="svd")
    with pytest.raises(ValueError, match="rank"):
        relative_error(-1, 4, 4)
    with pytest.raises(ValueError, match="shape"):
        error_curve(0, 4)


# --- ErrorModel ---------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_error_model_of_one_shape_is_that_shape(method: str) -> None:
    model = ErrorModel([(64, 256)], method=method)
    curve = error_curve(64, 256, method=method)
    assert model.max_rank == 64
    for r in range(65):
        assert model.g(r) == pytest.approx(curve[r], abs=1e-15)
    assert model.g(2.5) == pytest.approx(0.5 * (curve[2] + curve[3]), abs=1e-15)
    assert model.g(1000) == 0.0


def test_error_model_weights_squared_errors_by_element_count() -> None:
    shapes = [(32, 64), (16, 128), (32, 64)]
    model = ErrorModel(shapes)
    for r in (0, 4, 10, 16, 20, 31, 32):
        num = sum(m * n * relative_error(r, m, n) ** 2 for m, n in shapes)
        den = sum(m * n for m, n in shapes)
        assert model.g(r) == pytest.approx(math.sqrt(num / den), abs=1e-12)
    # A repeated shape changes nothing when every shape is repeated equally.
    assert np.array_equal(ErrorModel([(32, 64)] * 3).table, ErrorModel([(32, 64)]).table)


def test_error_model_predicts_real_gaussian_truncation_error() -> None:
    # The aggregate is the expected error of truncating every matrix at the same rank.
    rng = np.random.default_rng(11)
    shapes = [(48, 96), (24, 160), (48, 48)]
    mats = [rng.standard_normal(s) for s in shapes]
    model = ErrorModel(shapes)
    for r in (4, 12, 24, 36):
        err_sq = sum(_truncation_error(a, r) ** 2 for a in mats)
        total_sq = sum(float(np.linalg.norm(a)) ** 2 for a in mats)
        assert math.sqrt(err_sq / total_sq) == pytest.approx(model.g(r), abs=0.03), f"r={r}"


def test_g_inv_inverts_g() -> None:
    model = ErrorModel([(64, 256), (128, 128), (16, 32)])
    for r in (0.0, 0.5, 3.0, 7.25, 40.0, 99.9, 127.0, 128.0):
        assert model.g_inv(model.g(r)) == pytest.approx(r, abs=1e-6)
    assert model.g_inv(1.0) == 0.0
    assert model.g_inv(1.7) == 0.0
    assert model.g_inv(0.0) == 128.0
    assert model.g_inv(-0.1) == 128.0


def test_error_model_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        ErrorModel([])
    with pytest.raises(ValueError, match="method"):
        ErrorModel([(4, 4)], method="svd")
    model = ErrorModel([(4, 4)])
    with pytest.raises(ValueError):
        model.g(-1.0)
    with pytest.raises(ValueError):
        model.g_inv(math.nan)


# --- cqm_rank -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def model() -> ErrorModel:
    # A GPT-2-small-like block: attention qkv, attention out, MLP in, MLP out.
    return ErrorModel([(768, 2304), (768, 768), (768, 3072), (3072, 768)])


def test_cqm_rank_follows_entropy(model: ErrorModel) -> None:
    # Window-to-window entropy moves are small (the paper: a slow decline). They must
    # be: at r0 = 32 of 768, g(r0) ≈ 0.95, so a fall of -log g(r0) ≈ 0.05 nat already
    # asks for rank 0.
    r0 = 32.0
    assert cqm_rank(5.0, 4.99, r0, model) < r0  # entropy falls: compress harder
    assert cqm_rank(5.0, 5.01, r0, model) > r0  # entropy rises: keep more
    assert cqm_rank(5.0, 5.0, r0, model) == pytest.approx(r0, abs=1e-6)
    # A larger fall gives a lower rank, a larger rise a higher one.
    assert 0.0 < cqm_rank(5.0, 4.98, r0, model) < cqm_rank(5.0, 4.99, r0, model)
    assert cqm_rank(5.0, 5.02, r0, model) > cqm_rank(5.0, 5.01, r0, model)
    # The fall at which the error budget e^{ΔH}·g(r0) reaches 1, the error of rank 0.
    to_zero = -math.log(model.g(r0))
    assert cqm_rank(5.0, 5.0 - to_zero - 1e-3, r0, model) == 0.0
    assert cqm_rank(5.0, 5.0 - to_zero + 1e-3, r0, model) > 0.0


def test_cqm_rank_keeps_rank_on_non_finite_entropy(model: ErrorModel) -> None:
    assert cqm_rank(math.nan, 4.0, 24.0, model) == 24.0
    assert cqm_rank(4.0, math.inf, 24.0, model) == 24.0


def test_cqm_rank_extremes(model: ErrorModel) -> None:
    assert cqm_rank(1e6, 0.0, 32.0, model) == 0.0  # error budget above 1: rank 0
    assert cqm_rank(0.0, 1e6, 32.0, model) == model.max_rank  # budget ~0: full rank


def test_cqm_rank_holds_absolute_error_of_scaled_gaussian_gradient() -> None:
    # The paper's reading: for a Gaussian gradient σ ∝ e^H, so scaling σ by e^{-d} lowers
    # the entropy by d, and the rule picks the rank whose error matches the old absolute
    # error σ₀·g(r₀).
    m, n, r0, d = 128, 256, 32, 0.2
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(m, n, generator=gen, dtype=torch.float64) * 0.01
    b = a * math.exp(-d)

    h0, h1 = gaussian_entropy(a), gaussian_entropy(b)
    assert h0 - h1 == pytest.approx(d, abs=1e-9)
    assert histogram_entropy(a) - histogram_entropy(b) == pytest.approx(d, abs=1e-4)

    model = ErrorModel([(m, n)])
    r1 = cqm_rank(h0, h1, r0, model)
    assert r1 < r0
    # The rule itself: e^{-d}·g(r1) = g(r0) in relative terms of each σ.
    assert math.exp(-d) * model.g(r1) == pytest.approx(model.g(r0), rel=1e-9)
    # And on the real matrices: truncating the shrunk gradient at r1 costs about the
    # same absolute error as truncating the original at r0.
    err0 = _truncation_error(a.numpy(), r0)
    err1 = _truncation_error(b.numpy(), round(r1))
    assert err1 == pytest.approx(err0, rel=0.03)
