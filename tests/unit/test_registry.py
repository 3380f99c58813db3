"""The policy registry: a policy added as docs/developing.md shows it trains through the
DDP hook and resumes exactly; names are checked; the built-in policies are all there."""

import re
from pathlib import Path

import pytest
import torch

from edgc import EDGCConfig, EDGCState, edgc_hook
from edgc.comm.buckets import sync_with_hook
from edgc.policy import registry
from edgc.policy.base import RankPolicy

DOC = Path(__file__).resolve().parents[2] / "docs" / "developing.md"


@pytest.fixture
def halving():
    """The example of docs/developing.md, run as the page writes it; unregistered after."""
    text = DOC.read_text()
    section = text[text.index("## Adding a policy"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, str(DOC), "exec"), namespace)
    yield namespace["HalvingPolicy"]
    registry._REGISTRY.pop("halving", None)


def _train(state: EDGCState, model: torch.nn.Module, steps: range) -> list[int]:
    """Plain SGD with the gradient through edgc_hook; returns each step's rank."""
    ranks = []
    for step in steps:
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        model.zero_grad()
        model(x).square().mean().backward()
        sync_with_hook(list(model.parameters()), state, edgc_hook, cap_bytes=400)
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
        ranks.append(state.stats().step_rank)
    return ranks


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 8))


def test_the_documented_policy_trains_through_the_hook_and_resumes_exactly(one_process_group, halving):
    config = EDGCConfig(policy="halving", max_rank=8, min_rank=1, rank_multiple=1, window=2, warmup="fixed",
                        warmup_steps=1, min_compression_rate=1.0)
    straight_model, straight = _model(), EDGCState(None, config)
    ranks = _train(straight, straight_model, range(9))
    assert ranks == [0, 8, 4, 4, 2, 2, 1, 1, 1]  # halved at each window end (steps 2, 4, 6), down to r_min
    assert straight.stats().entropy_seconds == 0  # it reads no signal: nothing was sampled

    model, state = _model(), EDGCState(None, config)
    _train(state, model, range(5))
    saved, weights = state.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    assert saved["policy"] == {"name": "halving", "state": {"rank": 2}}
    resumed_model, resumed = _model(), EDGCState(None, config)
    resumed_model.load_state_dict(weights)
    resumed.load_state_dict(saved)
    assert _train(resumed, resumed_model, range(5, 9)) == ranks[5:]
    for a, b in zip(resumed_model.parameters(), straight_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_names_are_checked(halving):
    assert registry.policy_names()[:6] == ("noise", "cqm", "linear", "static", "schedule", "critical")
    assert "halving" in registry.policy_names()
    registry.register_policy("halving", halving)  # (the same factory again: no change)
    with pytest.raises(ValueError, match="'halving' is taken"):
        registry.register_policy("halving", RankPolicy)
    with pytest.raises(ValueError, match="'budget' is taken"):
        registry.register_policy("budget", RankPolicy)
    with pytest.raises(ValueError, match="non-empty name"):
        registry.register_policy("", RankPolicy)
    with pytest.raises(ValueError, match=r"EDGCConfig.policy='nope': must be one of \('noise'"):
        EDGCConfig(policy="nope")


def test_a_factory_must_build_a_rank_policy():
    registry.register_policy("not-a-policy", lambda config: object())
    try:
        with pytest.raises(TypeError, match="not a RankPolicy"):
            EDGCState(None, EDGCConfig(policy="not-a-policy"))
    finally:
        registry._REGISTRY.pop("not-a-policy")


def test_experimental_policies_are_marked():
    marked = {name for name in registry.policy_names() if getattr(registry.policy_class(name), "experimental", False)}
    assert marked == {"critical"}
