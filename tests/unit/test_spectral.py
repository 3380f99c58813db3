"""The spectral policy: the effective rank read from PowerSGD's factors, and its rank rule."""

import math

import torch

from edgc.compress import orthogonalize_
from edgc.policy.spectral import effective_ranks, spectral_rank


def _erank_from_svd(a: torch.Tensor) -> float:
    s2 = torch.linalg.svdvals(a).pow(2)
    p = s2 / s2.sum()
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))


def test_effective_rank_of_q_is_that_of_the_approximation_p_q_transposed():
    g = torch.Generator().manual_seed(0)
    m = torch.randn(3, 40, 30, generator=g, dtype=torch.float64)
    q0 = torch.randn(3, 30, 6, generator=g, dtype=torch.float64)
    p = m @ q0
    orthogonalize_(p)
    q = m.transpose(-1, -2) @ p  # one PowerSGD round: P orthonormal, Q = Mᵀ P
    got = effective_ranks(q)
    want = torch.tensor([_erank_from_svd(p[i] @ q[i].T) for i in range(3)], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_effective_rank_bounds_and_scale_invariance():
    flat = torch.eye(8, 4, dtype=torch.float64).unsqueeze(0) * 3.0  # 4 equal directions
    assert math.isclose(float(effective_ranks(flat)[0]), 4.0, rel_tol=1e-12)
    one = torch.zeros(1, 8, 4)
    one[0, :, 0] = torch.arange(8.0)  # all energy in one direction
    assert math.isclose(float(effective_ranks(one)[0]), 1.0, rel_tol=1e-9)
    q = torch.randn(2, 16, 5, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(effective_ranks(q), effective_ranks(q * 1e-3))
    assert math.isnan(float(effective_ranks(torch.zeros(1, 8, 4))[0]))


def test_rank_moves_towards_headroom_times_effective_rank_within_a_factor_of_two():
    assert spectral_rank(16, 11.0, 1.5, r_min=2, r_max=64, multiple=2) == 16  # 16.5: inside the dead band
    assert spectral_rank(16, 6.5, 1.5, r_min=2, r_max=64, multiple=2) == 8  # 9.75, shrinking: rounded down
    assert spectral_rank(16, 13.0, 1.5, r_min=2, r_max=64, multiple=2) == 20  # 19.5, growing: rounded up
    assert spectral_rank(16, 16.0, 4.0, r_min=2, r_max=64, multiple=2) == 32  # 64, clipped to 2x
    assert spectral_rank(16, 1.0, 1.5, r_min=2, r_max=64, multiple=2) == 8  # 1.5, clipped to 1/2
    assert spectral_rank(16, 16.0, 4.0, r_min=2, r_max=24, multiple=2) == 24  # r_max
    assert spectral_rank(4, 1.0, 1.5, r_min=3, r_max=24, multiple=2) == 3  # r_min
    assert spectral_rank(16, math.nan, 1.5, r_min=2, r_max=64, multiple=2) == 16


def test_small_ranks_can_grow_and_shrink():
    # erank <= rank, so rounding 1.5 * erank to the nearest would hold rank 2 for ever
    assert spectral_rank(2, 1.9, 1.5, r_min=1, r_max=64, multiple=2) == 4  # 2.85: up to the next multiple
    assert spectral_rank(1, 1.0, 1.5, r_min=1, r_max=64, multiple=2) == 2
    assert spectral_rank(2, 1.05, 1.5, r_min=1, r_max=64, multiple=2) == 1


def test_a_flat_spectrum_grows_the_rank_and_a_steep_one_settles_below_it():
    # energy falling like i^-a: the rule's fixed point moves up as the spectrum flattens
    def settle(a: float, rank: int = 32) -> int:
        for _ in range(20):
            lam = torch.tensor([i ** -a for i in range(1, rank + 1)], dtype=torch.float64)
            q = torch.diag(lam.sqrt()).unsqueeze(0)  # (1, r, r): singular values sqrt(lam)
            rank = spectral_rank(rank, float(effective_ranks(q)[0]), 1.5, r_min=2, r_max=64, multiple=2)
        return rank
    steep, medium, flat = settle(2.0), settle(1.0), settle(0.2)
    assert steep <= 6 and 10 <= medium <= 24 and flat == 64
