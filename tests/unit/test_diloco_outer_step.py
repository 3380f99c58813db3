"""edgc.diloco.DiLoCo in one process: the outer step against the paper's update in float64,
the inner steps untouched between syncs, the state round trip and the refusals."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from edgc import EDGCConfig
from edgc.diloco import DiLoCo, _shift


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def _inner_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def test_the_outer_step_is_nesterov_sgd_on_the_weights_change_in_float64():
    """One replica, H = 3, lr 0.7, momentum 0.9: after each 3rd inner step the weights are
    θ - η (Δ + μ b) with b ← μ b + Δ and Δ = θ - θ_local, computed here by hand."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = DiLoCo(model, opt, inner_steps=3, outer_lr=0.7, outer_momentum=0.9)
    theta = [p.detach().clone() for p in model.parameters()]
    buf: list[torch.Tensor | None] = [None] * len(theta)
    for step in range(1, 10):
        _inner_step(model, opt, step)
        local = [p.detach().clone() for p in model.parameters()]
        synced = diloco.step()
        assert synced == (step % 3 == 0) and diloco.synced == synced
        if not synced:  # (between syncs the inner steps are left as they are)
            assert all(torch.equal(a, b) for a, b in zip(local, model.parameters(), strict=True))
            continue
        for i, (t, loc) in enumerate(zip(theta, local, strict=True)):
            delta = t - loc
            buf[i] = delta.clone() if buf[i] is None else 0.9 * buf[i] + delta
            theta[i] = t - 0.7 * (delta + 0.9 * buf[i])
        for t, p in zip(theta, model.parameters(), strict=True):
            torch.testing.assert_close(p.detach(), t, rtol=0, atol=1e-15)
    stats = diloco.stats()
    assert stats.step == 9 and stats.bytes_sent == 0  # (one process sends nothing)
    assert stats.bytes_uncompressed == 9 * sum(p.numel() * 8 for p in model.parameters())
    assert stats.state_bytes == 2 * sum(p.numel() * 8 for p in model.parameters())  # (θ and the momentum)


def test_the_momentums_prediction_is_the_least_squares_fit_per_tensor_in_float64():
    """edgc-diloco compresses Δ - c b: c b is, tensor by tensor, the multiple of the outer
    momentum b nearest Δ, so what is left is orthogonal to b. None before the first outer
    step (no b yet) and without momentum."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = DiLoCo(model, opt, inner_steps=2, outer_lr=0.5, outer_momentum=0.8)
    delta = torch.randn(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    assert diloco._momentum_fit(delta, 1) is None
    for step in range(1, 7):
        _inner_step(model, opt, step)
        diloco.step()
    fit = diloco._momentum_fit(delta, 1)
    assert fit is not None and len(fit) == len(diloco.global_params)
    rest = delta.clone()
    _shift(rest, fit, -1)
    offset = 0
    for g, (c, b) in zip(diloco.global_params, fit, strict=True):
        assert torch.equal(b, diloco.outer_optimizer.state[g]["momentum_buffer"].reshape(-1))
        part, left = delta[offset:offset + b.numel()], rest[offset:offset + b.numel()]
        offset += b.numel()
        torch.testing.assert_close(c, torch.dot(part, b) / torch.dot(b, b), rtol=1e-14, atol=0)
        assert abs(float(torch.dot(left, b))) < 1e-12 * float(part.norm() * b.norm())  # (the rest is ⟂ b)
    _shift(rest, fit, 1)
    torch.testing.assert_close(rest, delta, rtol=0, atol=1e-14)
    plain = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), inner_steps=1, outer_momentum=0.0)
    plain.step()
    assert plain._momentum_fit(delta, 1) is None


def test_a_state_round_trip_resumes_exactly_mid_phase():
    """Stopped after 4 inner steps (H = 3: one into the second phase), the model, the
    optimiser and DiLoCo's state restored into fresh objects continue bit for bit."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = DiLoCo(model, opt, inner_steps=3)
    for step in range(1, 5):
        _inner_step(model, opt, step)
        diloco.step()
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), diloco.state_dict())
    for step in range(5, 11):
        _inner_step(model, opt, step)
        diloco.step()
    model2 = _model()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    resumed = DiLoCo(model2, opt2, inner_steps=3)
    resumed.load_state_dict(saved[2])
    for step in range(5, 11):
        _inner_step(model2, opt2, step)
        resumed.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True))
    assert resumed.state_dict()["step"] == 10


@pytest.mark.parametrize("kwargs, words", [
    ({"inner_steps": 0}, "inner_steps=0 must be an integer >= 1"),
    ({"inner_steps": True}, "inner_steps=True"),
    ({"inner_steps": 5, "outer_lr": 0}, "outer_lr=0 must be a finite number > 0"),
    ({"inner_steps": 5, "outer_lr": float("nan")}, "outer_lr=nan"),
    ({"inner_steps": 5, "outer_momentum": 1.0}, "outer_momentum=1.0 must be in [0, 1)"),
    ({"inner_steps": 5, "outer_momentum": -0.1}, "outer_momentum=-0.1"),
])
def test_bad_settings_are_refused_in_one_line(kwargs, words):
    model = _model()
    with pytest.raises(ValueError, match=None) as exc:
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
    assert words in str(exc.value) and "\n" not in str(exc.value)


def test_a_state_of_another_run_is_refused_naming_the_difference():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = DiLoCo(model, opt, inner_steps=3).state_dict()
    with pytest.raises(ValueError, match="inner_steps=3, this one has 4"):
        DiLoCo(model, opt, inner_steps=4).load_state_dict(state)
    with pytest.raises(ValueError, match="differ in compression"):
        DiLoCo(model, opt, inner_steps=3, compression=EDGCConfig(max_rank=2)).load_state_dict(state)
    # the int4 wire's error feedback (DiLoCo's, of all of Δ) against the core's, either way
    int4 = DiLoCo(model, opt, inner_steps=3, compression=EDGCConfig(max_rank=2, wire="int4"))
    assert int4.error is not None and int4.sync.config.use_error_feedback is False
    saved4 = int4.state_dict()
    assert saved4["error"].shape == (sum(p.numel() for p in model.parameters()),)
    with pytest.raises(ValueError, match="differ in where the error feedback is kept"):
        DiLoCo(model, opt, inner_steps=3, compression=EDGCConfig(max_rank=2)).load_state_dict(saved4)
    with pytest.raises(ValueError, match="differ in where the error feedback is kept"):
        int4.load_state_dict(DiLoCo(model, opt, inner_steps=3, compression=EDGCConfig(max_rank=2)).state_dict())
    # (without error feedback asked for, the int4 wire keeps none either)
    assert DiLoCo(model, opt, inner_steps=3, compression=EDGCConfig(max_rank=2, wire="int4",
                                                                   use_error_feedback=False)).error is None
    other = nn.Linear(6, 5).double()
    with pytest.raises(ValueError, match="saved for a model of"):
        DiLoCo(other, torch.optim.SGD(other.parameters(), lr=0.1), inner_steps=3).load_state_dict(state)
    with pytest.raises(ValueError, match="not a DiLoCo state"):
        DiLoCo(model, opt, inner_steps=3).load_state_dict({"format": "something else"})
