"""A state saved by edgc 0.1 (format version 1) loads and resumes as edgc 0.1 did: the same
ranks, the stats within 1e-6 and the weights to float tolerance (since the batched round of
0.2.0, not bit for bit).

tests/data/v1_states.pt holds, for each case, a version-1 state_dict saved after 4 steps
of a small model, the weights then, and what edgc 0.1 did in the 4 steps after resuming
from it: the final weights, the stats and the rank of each step. It was made by
tests/data/make_v1_states.py, run against the 0.1 code (its docstring says how); this
file replays the same 4 steps on today's code.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import edgc.comm.step
from edgc import EDGCConfig, EDGCState, edgc_hook
from edgc.comm.buckets import sync_with_hook
from edgc.config import upgrade_config_v1

DATA = Path(__file__).parents[1] / "data" / "v1_states.pt"
SAVED: dict[str, dict[str, Any]] = torch.load(DATA, weights_only=True)  # (as edgc loads files: no code)
STEPS_BEFORE, STEPS_AFTER = 4, 4  # (as make_v1_states.py saved them)
TIMING = ("compress_seconds", "comm_seconds", "entropy_seconds")


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.Linear(10, 6))


def _steps(model: torch.nn.Module, state: EDGCState, start: int, n: int, lrs: list[float] | None,
           dtype: torch.dtype = torch.float32) -> list[int]:
    """n steps of plain SGD with the gradient synchronised through edgc_hook, as
    make_v1_states.py ran them (the inputs in `dtype`, the model's); returns the rank each
    step was sent at (0: uncompressed)."""
    ranks = []
    for step in range(start, start + n):
        if lrs is not None:
            state.set_learning_rate(lrs[step])
        x = torch.randn(8, 12, generator=torch.Generator().manual_seed(step)).to(dtype)
        model.zero_grad()
        model(x).square().mean().backward()
        sync_with_hook(list(model.parameters()), state, edgc_hook, cap_bytes=200)
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
        ranks.append(state.stats().step_rank)
    return ranks


def _difference(a: Any, b: Any, where: str = "", rel: float = 0.0) -> str | None:
    """Where `a` and `b` first differ, or None: tensors by torch.equal (and dtype), floats
    with nan equal to nan (and within `rel` of each other), lists and tuples alike, tables
    key by key."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
        return None if same else f"{where or 'value'}: {a!r} != {b!r}"
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{where or 'table'}: keys {sorted(a.keys() ^ b.keys())} in only one"
        for k in a:
            found = _difference(a[k], b[k], f"{where}[{k!r}]", rel)
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{where or 'list'}: {len(a)} items != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = _difference(x, y, f"{where}[{i}]", rel)
            if found:
                return found
        return None
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return None
    if rel and isinstance(a, float) and isinstance(b, float) and math.isclose(a, b, rel_tol=rel):
        return None
    return None if a == b else f"{where or 'value'}: {a!r} != {b!r}"


def _config(v1_config: dict[str, Any]) -> EDGCConfig:
    return EDGCConfig.from_dict(upgrade_config_v1(v1_config))


def _resume(saved: dict[str, Any]) -> tuple[torch.nn.Module, EDGCState, list[int]]:
    """Today's state loaded from the saved version-1 state, and the 4 steps after it."""
    v1 = copy.deepcopy(saved["state"])  # (SAVED is shared by the tests: nothing may change it)
    state = EDGCState(None, _config(v1["config"]))
    state.load_state_dict(v1)
    model = _model(seed=1)
    model.load_state_dict(saved["weights_at_4"])
    ranks = _steps(model, state, STEPS_BEFORE, STEPS_AFTER, saved["lrs"])
    return model, state, ranks


def test_the_fixture_is_what_the_tests_expect():
    assert set(SAVED) >= {"noise-gradient", "cqm-fixed", "linear-fixed", "static-whole-step", "critical-fixed",
                          "schedule"}
    for name, saved in SAVED.items():
        assert saved["state"]["format"] == "edgc-state" and saved["state"]["version"] == 1, name
        assert saved["state"]["step"] == STEPS_BEFORE, name
        assert {k: saved["state"]["config"][k] for k in saved["config"]} == saved["config"], name
        assert len(saved["ranks"]) == STEPS_BEFORE + STEPS_AFTER, name


def test_a_v1_config_keeps_its_meaning():
    """The warm-up of 0.1's three fields as today's one, and the renamed fields."""
    configs = {name: _config(saved["state"]["config"]) for name, saved in SAVED.items()}
    noise = configs["noise-gradient"]
    assert (noise.policy, noise.warmup, noise.warmup_max_error, noise.warmup_steps) == ("noise", "gradient", 0.9, 4)
    for name in ("cqm-fixed", "linear-fixed", "static-whole-step", "critical-fixed", "schedule"):
        assert (configs[name].warmup, configs[name].warmup_steps) == ("fixed", 1), name
    assert configs["static-whole-step"].sync_mode == "whole-step"
    assert configs["cqm-fixed"].sync_mode == "pipelined"
    assert configs["critical-fixed"].critical.threshold == 0.3
    assert configs["schedule"].schedule.ranks == "0:4,4:2"
    # (0.1 sent P and Q in the gradient's dtype and kept the error feedback in the working one)
    assert {(c.wire, c.state_dtype) for c in configs.values()} == {("native", "float32")}


@pytest.mark.parametrize("case", list(SAVED))
def test_a_v1_state_resumes_as_edgc_0_1_did(one_process_group, monkeypatch, case):
    saved = SAVED[case]
    # the control vector has grown by one float64 since edgc 0.1 (the warm-up check's
    # pooled total): 8 more bytes for each control all-reduce after the resume
    controls = []
    counted = edgc.comm.step.control_values
    monkeypatch.setattr(edgc.comm.step, "control_values", lambda *a, **k: controls.append(1) or counted(*a, **k))
    model, state, ranks = _resume(saved)
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    assert weights.keys() == saved["weights_at_8"].keys()
    # (to float tolerance, not bit for bit: since edgc 0.2.0 the round works on each shape's
    # matrices as one batch and subtracts P Q^T from M inside the matmul, a rounding of its own)
    for k, expected in saved["weights_at_8"].items():
        torch.testing.assert_close(weights[k], expected, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, k=k: f"{case}: weight {k} differs from edgc 0.1's: {m}")
    stats = dataclasses.asdict(state.stats())
    for name, expected in saved["stats_at_8"].items():
        if name in TIMING:
            continue
        assert name in stats, f"{case}: stats() lacks {name!r}"
        if name == "bytes_sent":
            expected += 8 * len(controls)
        message = f"{case}: stats().{name} = {stats[name]!r}, edgc 0.1 had {expected!r}"
        assert _difference(stats[name], expected, rel=1e-6) is None, message
    assert ranks == saved["ranks"][STEPS_BEFORE:], case


def test_a_v1_state_of_half_precision_gradients_keeps_its_error_feedback_in_float32(one_process_group):
    """edgc 0.1 kept the error feedback of bf16 and fp16 gradients in float32 (the working
    dtype), and saved it so: resumed, it stays float32, not rounded to today's default, bf16."""
    saved = SAVED["linear-fixed"]
    v1 = copy.deepcopy(saved["state"])
    for g in v1["groups"]:  # (as 0.1 saved a bf16 model's state: the gradient's dtype, Q and error in float32)
        assert g["q"].dtype == g["error"].dtype == torch.float32
        g["dtype"] = "bfloat16"
    state = EDGCState(None, _config(v1["config"]))
    state.load_state_dict(v1)
    model = _model(seed=1).to(torch.bfloat16)
    model.load_state_dict(saved["weights_at_4"])
    _steps(model, state, STEPS_BEFORE, 1, saved["lrs"], torch.bfloat16)
    groups = state.state_dict()["compression"]["groups"]
    assert groups and all(g["dtype"] == "bfloat16" for g in groups)
    assert [(g["q"].dtype, g["error"].dtype) for g in groups] == [(torch.float32, torch.float32)] * len(groups)


def _untimed(d: dict[str, Any]) -> dict[str, Any]:
    """A state_dict less the seconds in its "stats"."""
    return {**d, "stats": {k: v for k, v in d["stats"].items() if k not in TIMING}}


@pytest.mark.parametrize("case", list(SAVED))
def test_after_a_v1_resume_the_state_saves_as_v2_and_round_trips(one_process_group, case):
    _, state, _ = _resume(SAVED[case])
    saved = state.state_dict()
    assert saved["version"] == 2
    again = EDGCState(None, EDGCConfig.from_dict(saved["config"]))
    again.load_state_dict(copy.deepcopy(saved))
    reloaded = again.state_dict()
    found = _difference(_untimed(reloaded), _untimed(saved))
    assert found is None, f"{case}: {found}"
    # (a state may keep compress_seconds as a sum with the other two, as edgc 0.1 did, so
    # that a load gives it back within float rounding: timings are reports, not behaviour)
    for k in TIMING:
        assert math.isclose(reloaded["stats"][k], saved["stats"][k], rel_tol=1e-9, abs_tol=1e-12), (case, k)


def test_a_v1_state_of_a_removed_policy_is_refused(one_process_group):
    v1 = copy.deepcopy(SAVED["cqm-fixed"]["state"])
    state = EDGCState(None, _config(v1["config"]))
    v1["config"]["policy"] = "budget"
    with pytest.raises(ValueError, match="removed"):
        state.load_state_dict(v1)
    with pytest.raises(ValueError, match="removed"):
        upgrade_config_v1(v1["config"])
