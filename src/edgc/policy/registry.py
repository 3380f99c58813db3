"""The rank policies by name: what `EDGCConfig.policy` may say, and how each is built.

A policy is registered under a name with a factory that takes the EDGCConfig (usually the
policy's class). The synchroniser builds its policy here and never compares a policy's
name: what a policy needs it declares (`RankPolicy.signals`). To add one, write its module
under policy/ and add it to `_BUILTIN` below, or call `register_policy` from your own code
before building the config (docs/developing.md shows both).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from edgc.policy.base import RankPolicy
from edgc.policy.cqm import CQMPolicy
from edgc.policy.critical import CriticalPolicy
from edgc.policy.linear import LinearPolicy
from edgc.policy.noise import NoisePolicy
from edgc.policy.schedule import SchedulePolicy
from edgc.policy.static import StaticPolicy

__all__ = ["REMOVED", "make_policy", "policy_class", "policy_names", "policy_settings_class", "register_policy"]

#: A factory: the EDGCConfig in, a fresh policy out.
Factory = Callable[[Any], RankPolicy]

_BUILTIN: dict[str, Factory] = {
    "noise": NoisePolicy,  # the default (docs/policies.md says why)
    "cqm": CQMPolicy,  # the paper's rule
    "linear": LinearPolicy,  # the released code's rule
    "static": StaticPolicy,  # PowerSGD
    "schedule": SchedulePolicy,
    "critical": CriticalPolicy,  # experimental
}
_REGISTRY: dict[str, Factory] = dict(_BUILTIN)
#: A registered policy's settings dataclass (EDGCConfig.policy_settings), by policy name.
_SETTINGS: dict[str, type] = {}

#: Policies that existed once, with why they are gone (a config or a saved state that
#: names one is refused with this).
REMOVED: dict[str, str] = {
    "budget": "removed in edgc 0.2.0: it followed the noise policy at no gain (use \"noise\")",
    "spectral": "removed in edgc 0.2.0: it measured behind the static PowerSGD frontier (use \"noise\")",
}


def register_policy(name: str, factory: Factory, settings: type | None = None) -> None:
    """Make `name` a value of EDGCConfig.policy, built by `factory(config)`. `settings`: a
    dataclass of the policy's own settings, given in EDGCConfig.policy_settings as a table
    of its fields (or an instance) and read by the policy as `config.settings()`; its
    fields follow the rules of every config field (int, float, str, bool, or one of them
    or None), and a `check(bad)` method, if it has one, is called with `bad(field, why)`
    as NoiseConfig's is. Raises ValueError for an empty name or one taken by another
    factory (or the same factory with other settings), TypeError for settings that are
    not a dataclass."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a policy needs a non-empty name, got {name!r}")
    if settings is not None and not (isinstance(settings, type) and dataclasses.is_dataclass(settings)):
        raise TypeError(f"policy {name!r}: settings must be a dataclass, got {settings!r}")
    if name in REMOVED or name in _REGISTRY and (_REGISTRY[name] is not factory or _SETTINGS.get(name) is not settings):
        raise ValueError(f"policy name {name!r} is taken")
    _REGISTRY[name] = factory
    if settings is not None:
        _SETTINGS[name] = settings


def policy_settings_class(name: str) -> type | None:
    """The settings dataclass registered with policy `name` (None: it has none here; the
    built-in policies keep theirs in EDGCConfig's sections)."""
    return _SETTINGS.get(name)


def policy_names() -> tuple[str, ...]:
    """The registered names, built-in ones first."""
    return tuple(_REGISTRY)


def policy_class(name: str) -> Factory:
    """The factory registered as `name`; ValueError naming the choices otherwise."""
    if name not in _REGISTRY:
        why = REMOVED.get(name, f"must be one of {policy_names()}")
        raise ValueError(f"policy {name!r}: {why}")
    return _REGISTRY[name]


def make_policy(config: Any) -> RankPolicy:
    """A fresh policy for the EDGCConfig `config` (its `policy` names it)."""
    policy = policy_class(config.policy)(config)
    if not isinstance(policy, RankPolicy):
        raise TypeError(f"policy {config.policy!r}: its factory returned {type(policy).__name__}, not a RankPolicy")
    return policy
