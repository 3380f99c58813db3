"""Pure tensor maths of low-rank (PowerSGD) compression; no torch.distributed here."""

from edgc.compress.lowrank import (
    LONG_ASPECT,
    compressible,
    draw_q,
    error_feedback_,
    lowrank_error_sums,
    lowrank_errors_from_sums,
    lowrank_l1_error,
    matrix_rank,
    orthogonalize_,
    project_p,
    project_q,
    reconstruct,
    relative_lowrank_error,
    resize_q,
)

__all__ = [
    "LONG_ASPECT",
    "compressible",
    "draw_q",
    "error_feedback_",
    "lowrank_error_sums",
    "lowrank_errors_from_sums",
    "lowrank_l1_error",
    "matrix_rank",
    "orthogonalize_",
    "project_p",
    "project_q",
    "reconstruct",
    "relative_lowrank_error",
    "resize_q",
]
