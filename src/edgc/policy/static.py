"""The "static" policy: PowerSGD's fixed rank, r_max from the first compressed step on."""

from __future__ import annotations

from edgc.policy.base import RankPolicy

__all__ = ["StaticPolicy"]


class StaticPolicy(RankPolicy):
    """r_max throughout (the base policy's behaviour): the PowerSGD baseline every dynamic
    policy is measured against. It reads no signal, so it costs nothing to measure."""
