"""Low-rank compression maths in float64, against exact answers."""

import pytest
import torch

from edgc.compress import (
    compressible,
    error_feedback_,
    orthogonalize_,
    project_p,
    project_q,
    reconstruct,
    relative_lowrank_error,
    resize_q,
)


@pytest.fixture(autouse=True)
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _round(ms: list[torch.Tensor], q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One PowerSGD round over workers simulated in one process; returns (M_hat, new Q)."""
    p = sum(project_p(m, q) for m in ms)  # all-reduce SUM of P
    orthogonalize_(p)
    q_new = sum(project_q(m, p) for m in ms) / len(ms)  # all-reduce SUM of Q, / W
    return reconstruct(p, q_new), q_new


@pytest.mark.parametrize("rank", [1, 2, 5])
def test_orthogonalize_gives_orthonormal_columns(rank):
    p = torch.randn(3, 20, rank)
    orthogonalize_(p)
    eye = torch.eye(rank).expand(3, rank, rank)
    torch.testing.assert_close(p.transpose(1, 2) @ p, eye, rtol=0, atol=1e-12)


def test_gram_schmidt_in_half_precision_is_finite_and_orthonormal():
    p = torch.randn(2, 64, 4).to(torch.bfloat16)
    orthogonalize_(p)
    gram = (p.transpose(1, 2) @ p).float()
    torch.testing.assert_close(gram, torch.eye(4).expand(2, 4, 4).float(), rtol=0, atol=0.05)


def test_sent_plus_residual_equals_input():
    m = torch.randn(4, 30, 17)
    original = m.clone()
    m_hat, _ = _round([m], torch.randn(4, 17, 3))
    residual = error_feedback_(m, m_hat)
    torch.testing.assert_close(m_hat + residual, original, rtol=0, atol=1e-13)


@pytest.mark.parametrize("shape", [(12, 7), (7, 12), (9, 9)])
def test_full_rank_reproduces_plain_average(shape):
    workers = [torch.randn(2, *shape) for _ in range(3)]
    q = torch.randn(2, shape[1], min(shape))
    m_hat, _ = _round(workers, q)
    torch.testing.assert_close(m_hat, sum(workers) / 3, rtol=0, atol=1e-12)


def test_error_feedback_preserves_running_sum_of_averages():
    # Sum over steps of applied updates == sum of true averages - mean final residual.
    gen = torch.Generator().manual_seed(0)
    world, steps, shape, rank = 3, 25, (16, 10), 2
    errors = [torch.zeros(1, *shape) for _ in range(world)]
    q = torch.randn(1, shape[1], rank, generator=gen)
    applied = torch.zeros(1, *shape)
    truth = torch.zeros(1, *shape)
    for _ in range(steps):
        grads = [torch.randn(1, *shape, generator=gen) for _ in range(world)]
        truth += sum(grads) / world
        ms = [g + e for g, e in zip(grads, errors, strict=True)]
        m_hat, q = _round(ms, q)
        applied += m_hat
        errors = [error_feedback_(m, m_hat) for m in ms]
    torch.testing.assert_close(applied, truth - sum(errors) / world, rtol=0, atol=1e-11)
    assert not torch.allclose(applied, truth)  # compression really was lossy


def test_resize_q_keeps_warm_start_and_grows_from_generator():
    q = torch.randn(2, 9, 4)
    shrunk = resize_q(q, 2, torch.Generator().manual_seed(1))
    assert torch.equal(shrunk, q[..., :2])
    grown_a = resize_q(q, 6, torch.Generator().manual_seed(5))
    grown_b = resize_q(q, 6, torch.Generator().manual_seed(5))
    assert grown_a.shape == (2, 9, 6)
    assert torch.equal(grown_a[..., :4], q)
    assert torch.equal(grown_a, grown_b)  # replica-identical: same generator state, same columns
    assert resize_q(q, 4, torch.Generator()) is q


def test_rank_change_mid_training_keeps_error_feedback_invariant():
    gen = torch.Generator().manual_seed(3)
    shape = (20, 12)
    error = torch.zeros(1, *shape)
    q = torch.randn(1, shape[1], 4, generator=gen)
    applied, truth = torch.zeros(1, *shape), torch.zeros(1, *shape)
    for rank in [4, 4, 2, 2, 6, 6, 8, 3]:
        q = resize_q(q, rank, gen)
        g = torch.randn(1, *shape, generator=gen)
        truth += g
        m = g + error
        m_hat, q = _round([m], q)
        applied += m_hat
        error = error_feedback_(m, m_hat)
    torch.testing.assert_close(applied + error, truth, rtol=0, atol=1e-11)


def test_compressible_rules():
    assert not compressible((100,), 1, 0.0)  # 1-D never
    assert compressible((256, 256), 4, 2.0)  # 65536 >= 2 * 512 * 4
    assert not compressible((8, 8), 4, 2.0)  # 64 < 2 * 16 * 4
    assert compressible((16, 3, 3, 3), 2, 1.0)  # conv weights viewed as (16, 27)


def test_relative_lowrank_error_exact_on_known_spectrum():
    u, _ = torch.linalg.qr(torch.randn(10, 10))
    v, _ = torch.linalg.qr(torch.randn(6, 6))
    s = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0, 0.0])
    a = u[:, :6] @ torch.diag(s) @ v.T
    eps = relative_lowrank_error([a], [0, 1, 2, 4])
    total = float((s**2).sum())
    expected = [1.0, ((9 + 4 + 1) / total) ** 0.5, ((4 + 1) / total) ** 0.5, 0.0]
    assert eps == pytest.approx(expected, abs=1e-12)


def test_half_precision_orthogonalisation_keeps_the_basis():
    # P of a gradient has nearly dependent columns; Gram-Schmidt in bf16 loses them
    torch.manual_seed(0)
    base = torch.randn(2, 512, 1)
    p64 = base + 0.02 * torch.randn(2, 512, 16)  # (B, m, r), badly conditioned
    p = p64.to(torch.bfloat16)
    orthogonalize_(p)
    assert p.dtype == torch.bfloat16
    gram = p.double().transpose(1, 2) @ p.double()
    err = (gram - torch.eye(16, dtype=torch.float64)).abs().max()
    assert err < 0.02, f"orthogonality lost: max |P^T P - I| = {err:.3f}"


def test_lowrank_l1_error_matches_a_direct_svd_and_is_absolute():
    from edgc.compress import lowrank_l1_error

    torch.manual_seed(0)
    mats = [torch.randn(12, 9, dtype=torch.float64), torch.randn(5, 7, dtype=torch.float64)]
    errs = lowrank_l1_error(mats, [2, 5])
    for r, e in zip([2, 5], errs, strict=True):
        total = 0.0
        for a in mats:
            u, s, vh = torch.linalg.svd(a, full_matrices=False)
            total += float((a - u[:, :r] @ torch.diag(s[:r]) @ vh[:r]).abs().sum())
        assert e == pytest.approx(total / (12 * 9 + 5 * 7), rel=1e-12)
    assert errs[1] < errs[0]
    assert lowrank_l1_error([3 * m for m in mats], [2])[0] == pytest.approx(3 * errs[0], rel=1e-12)
