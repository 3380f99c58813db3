"""The "critical" rank policy as pure maths (float64, hand-computed values), its config,
the step learning-rate schedule that makes drops possible through `edgc train`, and the
state's learning-rate calls and older checkpoints."""

import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from edgc import EDGCConfig, EDGCState, edgc_hook
from edgc.comm.hook import EDGCStats
from edgc.policy.critical import CriticalRule, critical_rank, low_rank, lr_dropped
from edgc.policy.noise import noise_scale
from edgc.train.common import lr_at
from edgc.train.config import TrainConfig
from harness import assert_same  # (tests/distributed/, put on the path by tests/conftest.py)

NAN, INF = float("nan"), float("inf")


# ---------------------------------------------------------------- the rule


@pytest.mark.parametrize("n_new, rank, rho", [
    (1.0, 32, 0.5),  # rho exactly at the threshold: critical
    (3.0, 32, 0.5),  # the same change upwards
    (1.25, 16, 0.375),  # below
    (2.75, 16, 0.375),
    (0.5, 32, 0.75),  # above
    (2.0, 16, 0.0),  # no change at all
])
def test_rho_against_the_threshold(n_new, rank, rho):
    got = critical_rank(2.0, n_new, False, r_hi=32, r_lo=16, threshold=0.5)
    assert got == (rank, rho)


def test_just_below_the_threshold_is_low_rank():
    rank, rho = critical_rank(2.0, 1.0 + 2**-40, False, r_hi=32, r_lo=16, threshold=0.5)
    assert rank == 16 and rho == 0.5 - 2**-41


def test_a_learning_rate_drop_forces_the_high_rank_and_rho_is_still_reported():
    assert critical_rank(2.0, 2.0, True, r_hi=32, r_lo=16, threshold=0.5) == (32, 0.0)


@pytest.mark.parametrize("n_old, n_new", [
    (None, 1.0),  # the first window: nothing to compare with
    (0.0, 1.0),  # a zero norm: rho undefined
    (NAN, 1.0), (INF, 1.0), (-1.0, 1.0),
    (2.0, NAN), (2.0, INF),
])
def test_undefined_rho_keeps_the_high_rank(n_old, n_new):
    rank, rho = critical_rank(n_old, n_new, False, r_hi=32, r_lo=16, threshold=0.5)
    assert rank == 32 and math.isnan(rho)


@pytest.mark.parametrize("configured, r_min, r_max, multiple, expected", [
    (None, 8, 32, 2, 16),  # r_max // 2
    (None, 1, 10, 4, 4),  # 5 rounded to a multiple of 4
    (None, 1, 1, 2, 1),  # at least 1, and never above r_max
    (12, 8, 32, 2, 12),
    (12, 8, 32, 8, 16),  # 12 / 8 = 1.5 rounds to 2 (Python's round: to even)
    (4, 8, 32, 2, 8),  # never below r_min
    (40, 8, 32, 2, 32),  # never above r_max (a calibrated one below the configured rank)
])
def test_low_rank(configured, r_min, r_max, multiple, expected):
    assert low_rank(configured, r_min, r_max, multiple) == expected


def test_learning_rate_drop_is_strictly_below_the_factor():
    assert lr_dropped(0.5, 1.0, 0.5) is False  # exactly half: not a drop
    assert lr_dropped(0.5 - 2**-53, 1.0, 0.5) is True
    assert lr_dropped(None, 1.0, 0.5) is False and lr_dropped(0.1, None, 0.5) is False


def test_rule_across_windows_with_learning_rates_and_a_nonfinite_window():
    rule = CriticalRule(threshold=0.5, lr_drop_factor=0.5)
    assert rule.lr_dropped() is False  # no rate given yet
    rule.observe_lr(1e-3)
    assert rule.close_window(4.0, rule.lr_dropped(), 32, 16) == 32  # the first window
    assert (math.isnan(rule.rho), rule.norm, rule.lr_reference, rule.lr_drop) == (True, 4.0, 1e-3, False)
    # no call in this window: the rate in force (1e-3) carries over, no drop
    assert rule.lr_dropped() is False
    assert rule.close_window(3.0, False, 32, 16) == 16  # rho = 1/4
    assert rule.rho == 0.25
    # a window with no finite step: r_hi, and the last finite norm stays the reference
    assert rule.close_window(NAN, False, 32, 16) == 32 and math.isnan(rule.rho)
    assert rule.previous_norm == 3.0
    # a drop to a tenth and back within one window still counts (the least rate)
    rule.observe_lr(1e-4)
    rule.observe_lr(1e-3)
    assert rule.lr_dropped() is True
    assert rule.close_window(3.0, rule.lr_dropped(), 32, 16) == 32 and rule.lr_drop is True
    assert rule.rho == 0.0
    assert rule.close_window(2.9, rule.lr_dropped(), 32, 16) == 16 and rule.lr_drop is False
    saved = rule.state_dict()
    again = CriticalRule(0.5, 0.5)
    again.load_state_dict(saved)
    assert again.state_dict() == saved


# ---------------------------------------------------------------- the noise scale


def test_noise_scale_against_a_hand_computation():
    # two replicas' gradients g1 = (1, 2), g2 = (3, 0): |G_small|² = (5 + 9) / 2 = 7, the
    # average (2, 1) gives |G_big|² = 5; |G|² = (2·5 − 7) / 1 = 3, tr(Σ)/b = 2·(7 − 5) / 1 = 4
    g = torch.tensor([[1.0, 2.0], [3.0, 0.0]], dtype=torch.float64)
    small = float(g.square().sum(dim=1).mean())
    big = float(g.mean(dim=0).square().sum())
    assert (small, big) == (7.0, 5.0)
    assert noise_scale(small, big, 2) == 4.0 / 3.0
    # three replicas: (1, 0), (0, 1), (1, 1): |G_small|² = 4/3, average (2/3, 2/3): |G_big|² = 8/9;
    # |G|² = (3·8/9 − 4/3) / 2 = 2/3, tr(Σ)/b = 3·(4/3 − 8/9) / 2 = 2/3: B_simple = b
    assert noise_scale(4 / 3, 8 / 9, 3) == pytest.approx(1.0, rel=1e-15)
    # the window's sums give the same ratio as its means
    assert noise_scale(5 * 7.0, 5 * 5.0, 2) == 4.0 / 3.0


@pytest.mark.parametrize("small, big, n", [(7.0, 5.0, 1), (7.0, 3.5, 2), (7.0, 1.0, 2), (NAN, 5.0, 2), (7.0, INF, 2)])
def test_noise_scale_is_nan_where_undefined(small, big, n):
    # one replica; |G|² estimated <= 0 (at and below); non-finite sums
    assert math.isnan(noise_scale(small, big, n))


def test_stats_scalars_leave_out_what_was_not_measured():
    base = dict(step=3, phase="compress", rank=4, step_phase="compress", step_rank=4, entropy=NAN, min_rank=1,
                max_rank=8, bytes_sent=100, bytes_uncompressed=400, compress_seconds=0.0, comm_seconds=0.0,
                entropy_seconds=0.0, nonfinite_steps=0, compressed_steps=2)
    scalars = EDGCStats(**base).scalars()
    assert not {"critical_rho", "window_norm", "lr_drop", "noise_scale"} & set(scalars)
    scalars = EDGCStats(**base, critical_rho=0.25, window_norm=3.0, lr_drop=True, noise_scale=12.5).scalars()
    assert (scalars["critical_rho"], scalars["window_norm"], scalars["lr_drop"], scalars["noise_scale"]) == (
        0.25, 3.0, 1.0, 12.5)


# ---------------------------------------------------------------- configs


@pytest.mark.parametrize("values, field", [
    (dict(critical_threshold=0.0), "critical.threshold"),
    (dict(critical_threshold=-0.5), "critical.threshold"),
    (dict(critical_threshold=NAN), "critical.threshold"),
    (dict(critical_low_rank=0), "critical.low_rank"),
    (dict(critical_low_rank=2**16 + 1), "critical.low_rank"),
    (dict(max_rank=16, critical_low_rank=32), "critical.low_rank"),
    (dict(max_rank=32, critical_low_rank=4), "critical.low_rank"),  # below max_rank // 4
    (dict(max_rank=32, min_rank=12, critical_low_rank=10), "critical.low_rank"),
    (dict(critical_low_rank=8.0), "critical.low_rank"),
    (dict(critical_lr_drop_factor=0.0), "critical.lr_drop_factor"),
    (dict(critical_lr_drop_factor=1.0), "critical.lr_drop_factor"),
    (dict(critical_lr_drop_factor=INF), "critical.lr_drop_factor"),
])
def test_critical_config_errors_name_the_field(values, field):
    with pytest.raises(ValueError, match=f"EDGCConfig.{field}="):
        EDGCConfig.from_dict(values)


def test_critical_config_defaults():
    cfg = EDGCConfig(policy="critical", max_rank=32)
    assert (cfg.critical.threshold, cfg.critical.low_rank, cfg.critical.lr_drop_factor) == (0.5, None, 0.5)
    config = EDGCConfig(policy="critical", max_rank=32, critical={"low_rank": 8})
    assert config.critical.low_rank == 8  # = max_rank // 4
    assert EDGCConfig(policy="critical").max_rank is None  # r_max may be calibrated


@pytest.mark.parametrize("values, message", [
    (dict(lr_schedule="step"), 'lr_drop_steps=\'\': lr_schedule "step" needs at least one step'),
    (dict(lr_drop_steps="600"), 'lr_drop_steps=\'600\': applies only to lr_schedule "step"'),
    (dict(lr_schedule="step", lr_drop_steps="600,600"), "the steps must increase: 600 follows 600"),
    (dict(lr_schedule="step", lr_drop_steps="0"), "'0' is not a step"),
    (dict(lr_schedule="step", lr_drop_steps="6e2"), "'6e2' is not a step"),
    (dict(lr_schedule="step", lr_drop_steps="600,"), "'' is not a step"),
    (dict(lr_schedule="step", lr_drop_steps="1" + "0" * 30), "is not a step"),
    (dict(lr_schedule="step", lr_drop_steps="600", lr_drop_gamma=1.0), r"lr_drop_gamma=1.0: must be in \(0, 1\)"),
    (dict(lr_schedule="step", lr_drop_steps="600", lr_drop_gamma=0.0), r"lr_drop_gamma=0.0: must be in \(0, 1\)"),
    (dict(lr_schedule="linear"), "lr_schedule='linear': must be one of"),
])
def test_step_schedule_errors_name_the_field(values, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        TrainConfig(out=str(tmp_path / "run"), data_cache=str(tmp_path / "cache"), **values).validate()


def test_step_schedule_learning_rates():
    cfg = TrainConfig(steps=10, lr=1.0, lr_warmup_steps=2, lr_schedule="step", lr_drop_steps=" 4, 8",
                      lr_drop_gamma=0.5).resolve()
    assert cfg.lr_drops() == [4, 8]
    assert [lr_at(s, cfg) for s in range(1, 11)] == [0.5, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25]
    cosine = TrainConfig(steps=10, lr=1.0, lr_warmup_steps=2).resolve()  # the default is unchanged
    assert cosine.lr_schedule == "cosine" and lr_at(2, cosine) == 1.0 and lr_at(10, cosine) == pytest.approx(0.1)


# ---------------------------------------------------------------- the state


def test_set_learning_rate_must_be_finite_and_not_negative():
    state = EDGCState(None, EDGCConfig(policy="critical", max_rank=8))
    for bad in (-1e-3, NAN, INF):
        with pytest.raises(ValueError, match="learning rate"):
            state.set_learning_rate(bad)
    state.set_learning_rate(0.0)
    state.set_learning_rate(3e-4)
    rule = state.sync.policy.rule
    assert (rule.lr, rule.lr_min) == (3e-4, 0.0)
    assert state.state_dict()["policy"]["state"]["rule"]["lr"] == 3e-4


def _steps(state: EDGCState, n: int, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 8))
    ddp = DDP(model)
    ddp.register_comm_hook(state, edgc_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(n):
        state.set_learning_rate(0.1)
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        ddp(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_critical_state_round_trip_keeps_the_window_sums(one_process_group):
    # one replica: the window norm is measured, the noise scale is not (nan)
    config = EDGCConfig(policy="critical", max_rank=4, warmup_steps=2, window=4, iteration_sample_rate=1.0,
                        min_compression_rate=1.0)
    state = EDGCState(None, config)
    _steps(state, 6)  # mid-window: the sums hold steps 5 and 6
    saved = state.state_dict()
    assert saved["window_gradient"]["steps"].item() == 2.0 and saved["window_gradient"]["total"].dtype == torch.float64
    stats = state.stats()
    assert stats.window_norm > 0 and math.isnan(stats.critical_rho) and math.isnan(stats.noise_scale)
    fresh = EDGCState(None, config)
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.sync.window_gradient.total, saved["window_gradient"]["total"])
    assert_same(fresh.sync.policy.state_dict(), saved["policy"]["state"])
    assert_same(fresh.state_dict()["window_gradient"], saved["window_gradient"])
