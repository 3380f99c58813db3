"""How the compression rank is decided. Pure objects: no torch.distributed here.

Every rank policy implements one small protocol (edgc.policy.base.RankPolicy) and is
found by name in the registry (edgc.policy.registry).
"""

from edgc.policy.base import RankPolicy, Signals, WindowEnd
from edgc.policy.calibration import calibrated_max_rank, probe_ranks
from edgc.policy.cqm import ErrorModel, cqm_rank, relative_error
from edgc.policy.linear import linear_rank
from edgc.policy.registry import make_policy, policy_names, register_policy
from edgc.policy.warmup import WarmupGate
from edgc.policy.window import EntropyWindow, limit_rank

__all__ = [
    "EntropyWindow",
    "ErrorModel",
    "RankPolicy",
    "Signals",
    "WarmupGate",
    "WindowEnd",
    "calibrated_max_rank",
    "cqm_rank",
    "limit_rank",
    "linear_rank",
    "make_policy",
    "policy_names",
    "probe_ranks",
    "register_policy",
    "relative_error",
]
