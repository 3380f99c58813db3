"""Low-rank gradient compression with error feedback (PowerSGD, Vogels et al. 2019).

One round on a batch of same-shape matrices M (B, m, n), with Q (B, n, r):

    P = M Q            -> all-reduce P (sum)         project_p
    orthogonalise P                                  orthogonalize_
    Q = M^T P          -> all-reduce Q, divide by W  project_q
    M_hat = P Q^T                                    reconstruct
    error = M - M_hat                                error_feedback_

The all-reduces live in edgc.comm; everything here is local arithmetic, so it is tested
in one process, in float64, against exact answers.
"""

from __future__ import annotations

import torch

from edgc.config import ORTHOGONALIZATIONS


def compressible(shape: tuple[int, ...] | torch.Size, rank: int, min_rate: float) -> bool:
    """True if a gradient of `shape` is worth compressing at `rank`.

    Tensors with fewer than 2 dimensions never are. Others are viewed as
    (shape[0], prod(shape[1:])) and compressed when m*n / ((m+n)*r) >= min_rate.
    """
    if len(shape) < 2:
        return False
    m = int(shape[0])
    n = 1
    for d in shape[1:]:
        n *= int(d)
    r = min(rank, m, n)
    return m * n >= min_rate * (m + n) * r


def orthogonalize_(p: torch.Tensor, method: str = "cholesky") -> torch.Tensor:
    """Orthonormalise the columns of each matrix in p (B, m, r), in place; returns p.

    "cholesky" (the default): shifted Cholesky-QR2 in float64 (`cholesky_qr2_`), a fixed
    dozen batched ops whatever B, m and r, and no host synchronisation. "householder":
    Gram-Schmidt for r <= 2 (cheap and stable enough there, as in torch's hook),
    Householder QR otherwise (on a GPU, one solver call per matrix of the batch once m
    exceeds a few hundred). Half-precision input is orthonormalised in float32 and rounded
    back once: Gram-Schmidt in bf16 loses orthogonality column by column (8 bits of
    mantissa), which would leave the basis skewed.
    """
    if method not in ORTHOGONALIZATIONS:
        raise ValueError(f"unknown orthogonalization {method!r}; choose from {ORTHOGONALIZATIONS}")
    if method == "cholesky":
        return cholesky_qr2_(p)
    if p.dtype in (torch.float16, torch.bfloat16):
        p.copy_(orthogonalize_(p.float(), method))
        return p
    r = p.shape[-1]
    if r <= 2:
        for i in range(r):
            col = p[..., i : i + 1]  # (B, m, 1)
            # clamp, not add: an all-zero column stays zero (and finite) without biasing
            # the norm of every other column, as adding an epsilon would
            norm = torch.linalg.vector_norm(col, dim=-2, keepdim=True)
            col.div_(norm.clamp_min(torch.finfo(p.dtype).tiny))
            if i + 1 < r:
                rest = p[..., i + 1 :]  # (B, m, r-i-1)
                rest.sub_(col @ (col.transpose(-1, -2) @ rest))
        return p
    q, _ = torch.linalg.qr(p, mode="reduced")  # (B, m, r)
    p.copy_(q)
    return p


def cholesky_shift(m: int) -> float:
    """The shift `cholesky_qr2_` adds to the diagonal of a float64 Gram matrix of m-row
    columns of unit norm: m times float64's machine epsilon, the most rounding can take off
    an eigenvalue of a Gram matrix summed over m products, so that the factorisation never
    meets a negative pivot (a rank-deficient P would otherwise give nan)."""
    return m * torch.finfo(torch.float64).eps


def cholesky_qr2_(p: torch.Tensor) -> torch.Tensor:
    """Shifted Cholesky-QR2 of each matrix in p (B, m, r), in place; returns p, its columns
    orthonormal and spanning the columns of the input.

    Worked in float64, whatever p's dtype: P is r/n of the gradient, and float32 Cholesky-QR2
    holds only up to a condition number of about 1/sqrt(eps) ~ 3e3, while a warm-started P
    reaches 1e6 (with float32 and a shift of m eps, orthogonality errors above 0.5 at a
    condition number of 1e6, tests/unit/test_orthogonalize.py; in float64, below
    Householder's float32 ones).
    Each column is first scaled to unit norm (an all-zero column stays zero), so that the
    Gram matrix's diagonal is 1 and one shift fits every matrix. Then twice: G = P^T P
    (B, r, r), plus `cholesky_shift` on its diagonal; G = L L^T (`cholesky_ex`, which never
    reads a flag to the host); P = P L^-T. The first pass orthogonalises up to the
    conditioning of P, the second what rounding left. The shift keeps a rank-deficient or
    all-zero P finite, with no column longer than 1 and all of P in its span; an all-zero
    column stays zero (Householder would fill it with an arbitrary direction; the power
    iteration's next P brings one back where the gradient has it). Full-rank P up to a
    condition number of 1e6 comes out at most twice as far from orthonormal as Householder
    QR leaves it, plus one float32 epsilon (tests/unit/test_orthogonalize.py).
    """
    x = p.to(torch.float64)  # (B, m, r); a copy unless p is float64
    x.div_(torch.linalg.vector_norm(x, dim=-2, keepdim=True).clamp_min_(torch.finfo(x.dtype).tiny))
    shift = cholesky_shift(p.shape[-2])
    for _ in range(2):
        gram = torch.bmm(x.mT, x)  # (B, r, r)
        gram.diagonal(dim1=-2, dim2=-1).add_(shift)
        chol, _ = torch.linalg.cholesky_ex(gram)  # (B, r, r) lower: gram = L L^T
        x = torch.linalg.solve_triangular(chol.mT, x, upper=True, left=False)  # X L^T = P: (B, m, r)
    return p.copy_(x)


def project_p(m: torch.Tensor, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """P = M Q: (B, m, n) @ (B, n, r) -> (B, m, r), written to `out` when given."""
    return torch.bmm(m, q, out=out)


def project_q(m: torch.Tensor, p: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Q = M^T P: (B, n, m) @ (B, m, r) -> (B, n, r), written to `out` when given."""
    return torch.bmm(m.transpose(1, 2), p, out=out)


def reconstruct(p: torch.Tensor, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """M_hat = P Q^T: (B, m, r) @ (B, r, n) -> (B, m, n), written to `out` when given."""
    return torch.bmm(p, q.transpose(1, 2), out=out)


def error_feedback_(m: torch.Tensor, m_hat: torch.Tensor) -> torch.Tensor:
    """Turn m into the compression error m - m_hat, in place; returns m.

    After the call, (what was sent) + m == (the input m), the EF invariant.
    """
    return m.sub_(m_hat)


def draw_q(
    batch: int, n: int, rank: int, generator: torch.Generator, *, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A random (batch, n, rank) matrix from `generator`.

    Drawn on the CPU in float32, so the same generator state gives the same matrix on
    every replica and every device, then moved to `device` and `dtype`.
    """
    q = torch.randn((batch, n, rank), generator=generator, dtype=torch.float32)
    return q.to(device=device, dtype=dtype)


def resize_q(q: torch.Tensor, rank: int, generator: torch.Generator) -> torch.Tensor:
    """Q (B, n, r) resized to (B, n, rank) keeping the warm start.

    Shrinking drops the trailing columns; growing appends new random columns from
    `generator` (replica-identical when the generator is), so the learned subspace and
    with it the error-feedback buffer stay valid across rank changes.
    """
    b, n, r = q.shape
    if rank == r:
        return q
    if rank < r:
        return q[..., :rank].contiguous()
    extra = draw_q(b, n, rank - r, generator, dtype=q.dtype, device=q.device)
    return torch.cat([q, extra], dim=-1)


#: A matrix whose longer side is at least this many times its shorter one is "long" and
#: compresses at EDGCConfig.long_rank_factor times the rank of the others (`matrix_rank`).
#: 5 is longer than any matrix of a transformer block (GPT-2's MLP matrices are 4:1,
#: Llama's 2.7:1) and shorter than the token embedding (vocabulary x width) of all but the
#: widest models: 65:1 in GPT-2 124M, 16:1 and 5.3:1 in the `tiny` and `small` presets,
#: 7.8:1 in Llama 2 7B.
LONG_ASPECT = 5


def matrix_rank(shape: tuple[int, int], rank: int, long_factor: float, multiple: int) -> int:
    """The rank an (m, n) matrix compresses at when the policy's rank is `rank`.

    A long matrix (longer side >= LONG_ASPECT x the shorter) takes `long_factor` x `rank`,
    rounded down to a multiple of `multiple` (at least 1); every other matrix takes `rank`.
    Both are capped by the matrix's shorter side. Why: at rank r an (m, n) matrix sends
    r (m + n) numbers for its m n, so a long matrix sends r / min(m, n) of itself, half the
    share a square one of the same width sends; twice the rank sends the same share.
    """
    m, n = shape
    if long_factor != 1 and max(m, n) >= LONG_ASPECT * min(m, n):
        rank = max(1, int(rank * long_factor) // multiple * multiple)
    return min(rank, m, n)


def _as_matrix(t: torch.Tensor) -> torch.Tensor:
    """t viewed as (shape[0], prod(shape[1:])), in float32 or better (for the SVD)."""
    a = t.reshape(t.shape[0], -1)
    return a if a.dtype in (torch.float32, torch.float64) else a.float()


def lowrank_error_sums(matrices: list[torch.Tensor], ranks: list[int], norm: str = "relative") -> list[float]:
    """The sums behind the error of the best rank-r approximation of each matrix, for
    each r in `ranks`, so that the matrices can be taken a few at a time and added up:
    `norm` "relative": [sum_i sum_{j>r} s_ij^2 for each r, then sum_i sum_j s_ij^2], from the
    singular values s_ij of matrix i (Eckart-Young-Mirsky), one SVD per matrix; "l1":
    [sum_i |A_i - A_i,r| for each r, then sum_i numel(A_i)], from a truncated SVD.
    In float32 or better, summed in float64; `lowrank_errors_from_sums` finishes them."""
    if norm not in ("relative", "l1"):
        raise ValueError(f'norm must be "relative" or "l1", got {norm!r}')
    tail = [0.0] * len(ranks)
    total = 0.0
    for mat in matrices:
        a = _as_matrix(mat)
        if norm == "relative":
            s2 = torch.linalg.svdvals(a).double().pow(2)  # (min(m, n),)
            total += float(s2.sum())
            for k, r in enumerate(ranks):
                tail[k] += float(s2[r:].sum())
        else:
            u, s, vh = torch.linalg.svd(a, full_matrices=False)  # (m, k), (k,), (k, n)
            for k, r in enumerate(ranks):
                approx = (u[:, :r] * s[:r]) @ vh[:r]  # (m, n)
                tail[k] += float((a - approx).abs().sum())
            total += a.numel()
    return [*tail, total]


def lowrank_errors_from_sums(sums: list[float], norm: str = "relative") -> list[float]:
    """The errors from `lowrank_error_sums` (added over any number of calls): "relative"
    the relative Frobenius error sqrt(tail / total), "l1" the mean absolute error per
    element tail / total; nan for every rank when total is 0 (no matrices)."""
    *tail, total = sums
    if total == 0.0:
        return [float("nan")] * len(tail)
    return [(t / total) ** 0.5 for t in tail] if norm == "relative" else [t / total for t in tail]


def relative_lowrank_error(matrices: list[torch.Tensor], ranks: list[int]) -> list[float]:
    """Relative Frobenius error of the best rank-r approximation, aggregated over matrices.

    For each r in `ranks`: sqrt(sum_i sum_{j>r} s_ij^2 / sum_i sum_j s_ij^2), where s_ij
    are the singular values of matrix i (Eckart-Young-Mirsky). Computed exactly with one
    SVD per matrix, in float32 or better. Returns one value per rank; nan if all are zero.
    """
    return lowrank_errors_from_sums(lowrank_error_sums(matrices, ranks, "relative"), "relative")


def lowrank_l1_error(matrices: list[torch.Tensor], ranks: list[int]) -> list[float]:
    """Mean absolute error per element, sum_i |A_i - A_i,r| / sum_i numel(A_i), of the best
    rank-r approximation of each matrix (truncated SVD), for each r in `ranks`.

    In gradient units (not relative): it shrinks as the gradient does. Computed in float32
    or better; nan when there are no elements.
    """
    return lowrank_errors_from_sums(lowrank_error_sums(matrices, ranks, "l1"), "l1")
