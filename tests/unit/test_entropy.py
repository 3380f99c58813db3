"""Tests for edgc.entropy: GDS sampling and the entropy estimators.

Random data comes from local torch.Generator objects, so the global RNG is untouched.
"""

from __future__ import annotations

import math

import pytest
import torch

from edgc.entropy import (
    estimate_entropy,
    gaussian_entropy,
    histogram_entropy,
    is_sampled_step,
    sample_gradient,
    sample_stride,
)

N = 200_000
SIGMA = 0.5


def _gaussian(n: int = N, sigma: float = SIGMA, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen, dtype=torch.float64) * sigma).to(dtype)


def _normal_entropy(sigma: float) -> float:
    """½·log(2πe·σ²), the differential entropy of N(0, σ²)."""
    return 0.5 * math.log(2.0 * math.pi * math.e * sigma**2)


# --- sampling -----------------------------------------------------------------------


@pytest.mark.parametrize("rate, stride", [(1.0, 1), (0.5, 2), (0.25, 4), (0.1, 10), (0.3, 3), (0.01, 100)])
def test_sample_stride(rate: float, stride: int) -> None:
    assert sample_stride(rate) == stride


@pytest.mark.parametrize("rate", [0.0, -0.25, 1.5, math.nan, math.inf])
def test_sample_stride_rejects_rates_outside_unit_interval(rate: float) -> None:
    with pytest.raises(ValueError, match="sampling rate"):
        sample_stride(rate)


@pytest.mark.parametrize("rate", [1.0, 0.5, 0.25, 0.1])
def test_sample_gradient_takes_every_kth_element_of_each_tensor(rate: float) -> None:
    gen = torch.Generator().manual_seed(1)
    # Sizes that are not multiples of k, a 3-D tensor and a non-contiguous (transposed) one.
    tensors = [
        torch.randn(7, 5, generator=gen),
        torch.randn(13, generator=gen),
        torch.randn(3, 4, 5, generator=gen),
        torch.randn(6, 9, generator=gen).t(),
        torch.randn(1, generator=gen),
    ]
    before = [t.clone() for t in tensors]
    k = sample_stride(rate)
    expected = torch.cat([t.flatten()[torch.arange(0, t.numel(), k)] for t in tensors])

    sampled = sample_gradient(tensors, rate)

    assert sampled.dtype == torch.float32 and sampled.dim() == 1
    assert torch.equal(sampled, expected)
    assert sampled.numel() == sum(math.ceil(t.numel() / k) for t in tensors)
    for t, b in zip(tensors, before, strict=True):
        assert torch.equal(t, b)  # inputs untouched


def test_sample_gradient_dtypes() -> None:
    half = torch.arange(16, dtype=torch.bfloat16)
    single = torch.arange(8, dtype=torch.float32)
    double = torch.arange(8, dtype=torch.float64)

    widened = sample_gradient([half], 0.25)
    assert widened.dtype == torch.float32
    assert widened.tolist() == [0.0, 4.0, 8.0, 12.0]

    mixed = sample_gradient([single, double], 0.5)
    assert mixed.dtype == torch.float64
    assert mixed.tolist() == [0.0, 2.0, 4.0, 6.0, 0.0, 2.0, 4.0, 6.0]

    assert sample_gradient([], 0.25).numel() == 0


def test_is_sampled_step_alpha_one_tenth() -> None:
    assert [s for s in range(1, 36) if is_sampled_step(s, 0.1)] == [10, 20, 30]


def test_is_sampled_step_alpha_one_samples_every_step() -> None:
    assert all(is_sampled_step(s, 1.0) for s in range(1, 50))


# --- estimators against known entropies ---------------------------------------------


def test_gaussian_sample_entropy() -> None:
    x = _gaussian()
    expected = _normal_entropy(SIGMA)
    assert histogram_entropy(x) == pytest.approx(expected, abs=0.02)
    assert gaussian_entropy(x) == pytest.approx(expected, abs=0.02)


def test_uniform_sample_differential_entropy_is_log_width() -> None:
    a = 3.0
    gen = torch.Generator().manual_seed(2)
    x = torch.rand(N, generator=gen) * a
    assert histogram_entropy(x) == pytest.approx(math.log(a), abs=0.02)


def test_histogram_entropy_exact_on_evenly_filled_bins() -> None:
    # 0..999 into 10 bins over [0, 999]: each bin holds exactly 100 values, so the discrete
    # entropy is log 10 and the differential one adds log(999 / 10).
    x = torch.arange(1000, dtype=torch.float64)
    assert histogram_entropy(x, bins=10, differential=False) == pytest.approx(math.log(10), abs=1e-12)
    assert histogram_entropy(x, bins=10) == pytest.approx(math.log(999), abs=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("c", [0.25, 3.0, 1e-3])
def test_scaling_shifts_differential_entropy_by_log_c(dtype: torch.dtype, c: float) -> None:
    x = _gaussian(dtype=dtype)
    y = x * c
    shift = math.log(c)
    assert histogram_entropy(y) - histogram_entropy(x) == pytest.approx(shift, abs=1e-4)
    assert gaussian_entropy(y) - gaussian_entropy(x) == pytest.approx(shift, abs=1e-4)
    # The release's discrete entropy does not see the scale at all.
    assert histogram_entropy(y, differential=False) == pytest.approx(histogram_entropy(x, differential=False), abs=1e-6)


# --- non-finite and degenerate input ------------------------------------------------


@pytest.mark.parametrize("estimator", ["histogram", "gaussian"])
def test_non_finite_values_are_ignored(estimator: str) -> None:
    x = _gaussian(n=10_000, dtype=torch.float64)
    poisoned = torch.cat([x[:5000], torch.tensor([math.nan, math.inf, -math.inf], dtype=x.dtype), x[5000:]])
    for differential in (True, False):
        clean = estimate_entropy(x, estimator, differential=differential)
        assert estimate_entropy(poisoned, estimator, differential=differential) == clean


@pytest.mark.parametrize("differential", [True, False])
def test_no_finite_values_gives_nan(differential: bool) -> None:
    all_nan = torch.full((100,), math.nan)
    assert math.isnan(histogram_entropy(all_nan, differential=differential))
    assert math.isnan(histogram_entropy(torch.tensor([math.inf, -math.inf]), differential=differential))
    assert math.isnan(histogram_entropy(torch.empty(0), differential=differential))
    assert math.isnan(gaussian_entropy(all_nan))


def test_constant_sample() -> None:
    x = torch.full((100,), 0.5)
    assert math.isnan(histogram_entropy(x))  # bin width 0: no differential entropy
    assert histogram_entropy(x, differential=False) == 0.0  # one occupied bin
    assert math.isnan(gaussian_entropy(x))  # σ = 0
    assert math.isnan(gaussian_entropy(torch.tensor([1.0, math.nan])))  # one finite value


# --- dispatch -----------------------------------------------------------------------


def test_estimate_entropy_dispatches() -> None:
    x = _gaussian(n=10_000)
    assert estimate_entropy(x) == histogram_entropy(x)
    assert estimate_entropy(x, "histogram", bins=50, differential=False) == histogram_entropy(
        x, bins=50, differential=False
    )
    assert estimate_entropy(x, "gaussian") == gaussian_entropy(x)


def test_unknown_estimator_names_the_config_field() -> None:
    with pytest.raises(ValueError, match="entropy_estimator"):
        estimate_entropy(torch.zeros(4), "kde")


def test_bins_must_be_positive() -> None:
    with pytest.raises(ValueError, match="bins"):
        histogram_entropy(torch.arange(4.0), bins=0)


def test_sampled_estimate_matches_full_estimate() -> None:
    # GDS at β = 0.25 should see the same entropy as the full gradient, to sampling error.
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(512, 768, generator=gen) * SIGMA, torch.randn(768, generator=gen) * SIGMA]
    full = histogram_entropy(torch.cat([g.flatten() for g in grads]))
    sampled = histogram_entropy(sample_gradient(grads, 0.25))
    assert sampled == pytest.approx(full, abs=0.02)
