"""How the compression rank is decided. Pure objects: no torch.distributed here."""

from edgc.policy.calibration import calibrated_max_rank, probe_ranks
from edgc.policy.cqm import ErrorModel, cqm_rank, relative_error
from edgc.policy.linear import linear_rank
from edgc.policy.warmup import WarmupGate
from edgc.policy.window import RankController, limit_rank

__all__ = [
    "ErrorModel",
    "RankController",
    "WarmupGate",
    "calibrated_max_rank",
    "cqm_rank",
    "limit_rank",
    "linear_rank",
    "probe_ranks",
    "relative_error",
]
