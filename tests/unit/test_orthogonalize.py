"""The orthogonalisation of P (edgc.compress.orthogonalize_): shifted Cholesky-QR2 in float64
against Householder QR, on well and badly conditioned, rank-deficient and all-zero P.

The bounds checked (and stated in cholesky_qr2_'s docstring and docs/method.md): for a P of
full rank up to a condition number of 1e6, Cholesky-QR2's orthogonality error max|P^T P - I|
is at most twice Householder's plus one float32 epsilon, and both span the same columns (the
part of a random M that each leaves out agrees to 1e-4 of M); for a rank-deficient or
all-zero P the result is finite, no column is longer than 1, all of P lies in its span, and
an all-zero column stays zero.
"""

import pytest
import torch

from edgc.compress import cholesky_qr2_, cholesky_shift, orthogonalize_

EPS32 = torch.finfo(torch.float32).eps


def _conditioned(m: int, r: int, cond: float, seed: int = 0) -> torch.Tensor:
    """Two (m, r) float32 matrices with singular values spread log-evenly from 1 to 1/cond."""
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(2, m, r, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(2, r, r, generator=g, dtype=torch.float64))
    s = torch.logspace(0, -torch.log10(torch.tensor(cond)).item(), r, dtype=torch.float64)
    return (u * s) @ v.mT


def _orthogonality_error(p: torch.Tensor) -> float:
    eye = torch.eye(p.shape[-1], dtype=torch.float64)
    return float((p.double().mT @ p.double() - eye).abs().amax())


def _left_out(p: torch.Tensor, m: torch.Tensor) -> float:
    """The share of m's norm that projecting onto p's columns leaves out."""
    p, m = p.double(), m.double()
    return float(torch.linalg.norm(m - p @ (p.mT @ m)) / torch.linalg.norm(m))


@pytest.mark.parametrize("rows", [64, 768, 3072])
@pytest.mark.parametrize("cond", [1.0, 1e3, 1e6])
def test_cholesky_qr2_is_as_orthogonal_as_householder_and_spans_the_same_columns(rows, cond):
    p = _conditioned(rows, 32, cond).float()
    m = torch.randn(2, rows, 100, generator=torch.Generator().manual_seed(1))
    chol = orthogonalize_(p.clone(), "cholesky")
    house = orthogonalize_(p.clone(), "householder")
    assert chol.dtype == torch.float32 and chol.isfinite().all()
    assert _orthogonality_error(chol) <= 2 * _orthogonality_error(house) + EPS32
    assert abs(_left_out(chol, m) - _left_out(house, m)) <= 1e-4


@pytest.mark.parametrize("case", ["duplicate and zero columns", "rank 4 of 32", "all zero"])
def test_a_rank_deficient_or_zero_p_stays_finite_bounded_and_loses_nothing_of_p(case):
    g = torch.Generator().manual_seed(2)
    if case == "all zero":
        p = torch.zeros(2, 256, 32)
    elif case == "rank 4 of 32":
        p = torch.randn(2, 256, 4, generator=g) @ torch.randn(2, 4, 32, generator=g)
    else:
        p = torch.randn(2, 256, 32, generator=g)
        p[:, :, 5] = p[:, :, 3]
        p[:, :, 7] = 0
    before = p.clone()
    out = orthogonalize_(p, "cholesky")
    assert out is p and p.isfinite().all()
    assert float(torch.linalg.vector_norm(p, dim=-2).amax()) <= 1 + 1e-5  # (no column blown up)
    # projecting P onto the result's columns leaves nothing of it out
    assert _left_out(p, before) <= 1e-5 or case == "all zero"
    if case == "all zero":
        assert torch.equal(p, torch.zeros_like(p))
    if case == "duplicate and zero columns":
        assert torch.equal(p[:, :, 7], torch.zeros_like(p[:, :, 7]))  # (a zero column stays zero)


def test_cholesky_qr2_of_a_float64_p_is_orthonormal_to_float64_precision():
    p = _conditioned(500, 16, 1e4, seed=3)
    cholesky_qr2_(p)
    assert _orthogonality_error(p) <= 1e-12


def test_half_precision_is_orthonormalised_in_float64_and_rounded_back_once():
    p = _conditioned(300, 8, 10.0, seed=4).to(torch.bfloat16)
    expected = cholesky_qr2_(p.double().clone()).to(torch.bfloat16)
    out = orthogonalize_(p, "cholesky")
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)


def test_the_shift_grows_with_the_rows_summed():
    assert cholesky_shift(2000) == 2 * cholesky_shift(1000) == 2000 * torch.finfo(torch.float64).eps


def test_an_unknown_orthogonalization_is_refused():
    with pytest.raises(ValueError, match="unknown orthogonalization 'qr'"):
        orthogonalize_(torch.randn(1, 4, 2), "qr")


def _cholesky_qr2_in_float32(p: torch.Tensor) -> torch.Tensor:
    """The same algorithm as cholesky_qr2_, worked in float32 (shift m times float32's eps)."""
    x = p.float().clone()
    x.div_(torch.linalg.vector_norm(x, dim=-2, keepdim=True).clamp_min_(torch.finfo(x.dtype).tiny))
    for _ in range(2):
        gram = torch.bmm(x.mT, x)
        gram.diagonal(dim1=-2, dim2=-1).add_(p.shape[-2] * EPS32)
        chol, _ = torch.linalg.cholesky_ex(gram)
        x = torch.linalg.solve_triangular(chol.mT, x, upper=True, left=False)
    return x


@pytest.mark.parametrize("rows", [768, 3072])
def test_float32_cholesky_qr2_fails_at_the_conditioning_a_warm_start_reaches(rows):
    """The reason cholesky_qr2_ works in float64 (its docstring, docs/method.md): at a
    condition number of 1e6 the float32 variant leaves P far from orthonormal (an error
    above 0.5), where the float64 one is within Householder's bound."""
    bad = _conditioned(rows, 32, 1e6).float()
    assert _orthogonality_error(_cholesky_qr2_in_float32(bad)) > 0.5
    house = _orthogonality_error(orthogonalize_(bad.clone(), "householder"))
    assert _orthogonality_error(orthogonalize_(bad.clone(), "cholesky")) <= 2 * house + EPS32
