"""The policy registry: a policy added as docs/developing.md shows it trains through the
DDP hook and resumes exactly; names are checked; the built-in policies are all there."""

import dataclasses
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
    with pytest.raises(ValueError, match="'halving' is taken"):  # (settings added to a name taken without)
        registry.register_policy("halving", halving, settings=dataclasses.make_dataclass("HalvingSettings", []))
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


@pytest.fixture
def shrink():
    """The example with settings of docs/developing.md, run as the page writes it."""
    text = DOC.read_text()
    section = text[text.index("## Adding a policy"):]
    code = re.findall(r"```python\n(.*?)```", section, re.S)[1]
    namespace: dict = {}
    exec(compile(code, str(DOC), "exec"), namespace)
    yield namespace
    registry._REGISTRY.pop("shrink", None)
    registry._SETTINGS.pop("shrink", None)


def test_a_registered_policy_with_settings_reads_them_trains_and_saves_them(one_process_group, shrink):
    config = shrink["config"]
    assert config.settings() == shrink["ShrinkSettings"](factor=0.75)
    assert config.to_dict()["policy_settings"] == {"factor": 0.75}
    assert EDGCConfig.from_dict(config.to_flat()) == config  # (a saved config.json's round trip)
    assert EDGCConfig(policy="shrink", policy_settings=shrink["ShrinkSettings"](0.25)).settings().factor == 0.25
    assert EDGCConfig(policy="shrink").settings().factor == 0.5  # (the dataclass's default)

    trained = EDGCConfig(policy="shrink", max_rank=8, min_rank=1, rank_multiple=1, window=2, warmup="fixed",
                         warmup_steps=1, min_compression_rate=1.0, policy_settings={"factor": 0.75})
    state = EDGCState(None, trained)
    assert _train(state, _model(), range(9)) == [0, 8, 6, 6, 4, 4, 3, 3, 2]  # 8 * 0.75 = 6, 4.5 -> 4, 3, 2.25 -> 2
    assert state.state_dict()["config"]["policy_settings"] == {"factor": 0.75}


def test_policy_settings_are_checked(shrink):
    with pytest.raises(ValueError, match=r"EDGCConfig.policy_settings.factor=1.5: must be in \(0, 1\)"):
        EDGCConfig(policy="shrink", policy_settings={"factor": 1.5})
    with pytest.raises(ValueError, match=r"policy_settings.factor='x': must be a finite number"):
        EDGCConfig(policy="shrink", policy_settings={"factor": "x"})
    with pytest.raises(ValueError, match=r"ShrinkSettings has no field\(s\) \['rate'\]"):
        EDGCConfig(policy="shrink", policy_settings={"rate": 0.5})
    with pytest.raises(ValueError, match="policy 'noise' takes no settings here"):
        EDGCConfig(policy="noise", policy_settings={"factor": 0.5})
    with pytest.raises(ValueError, match="'shrink' is taken"):  # (the same factory with other settings)
        registry.register_policy("shrink", shrink["ShrinkPolicy"], settings=None)
    with pytest.raises(TypeError, match="settings must be a dataclass"):
        registry.register_policy("other", shrink["ShrinkPolicy"], settings=dict)
    assert EDGCConfig().settings() is None  # (the built-in policies' settings are their sections)
