"""The "noise" rank policy as pure maths (float64, hand-computed values), the warm-up the
gradient ends (EDGCConfig.warmup_max_error) as a gate fed given errors, and their config:
both are the defaults, and a run saved before them resumes as it ran."""

import math

import pytest

from edgc import EDGCConfig
from edgc.policy import WarmupGate
from edgc.policy.noise import next_noise_rank, noise_rank
from edgc.train.checkpoint import save_checkpoint
from edgc.train.config import TrainConfig
from edgc.train.trainer import resume_config

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("noise, replicas, exponent, expected", [
    (1.0, 2, 0.5, 32.0),  # signal outweighs noise: r_max
    (2.0, 2, 0.5, 32.0),  # B = n exactly: still r_max
    (8.0, 2, 0.5, 16.0),  # 32 * (2/8)^0.5
    (32.0, 2, 0.5, 8.0),  # 32 * (1/16)^0.5
    (8.0, 4, 0.5, 32.0 * 0.5**0.5),  # twice the replicas: less noise in the average, higher rank
    (8.0, 2, 1.0, 8.0),  # 32 * (2/8)^1
    (3.0, 2, 2.0, 32.0 * 4.0 / 9.0),
])
def test_noise_rank_against_a_hand_computation(noise, replicas, exponent, expected):
    assert noise_rank(noise, replicas, 32, exponent) == pytest.approx(expected, rel=1e-15)


@pytest.mark.parametrize("noise, replicas", [(NAN, 2), (INF, 2), (0.0, 2), (-1.0, 2), (4.0, 1)])
def test_noise_rank_is_nan_where_the_noise_scale_is_unknown(noise, replicas):
    assert math.isnan(noise_rank(noise, replicas, 32, 0.5))


def test_the_rule_after_bounds_rounding_and_rate_limit():
    # the window decision as the hook makes it: clipped to r_min, rounded, moved at most rank_step
    def step(noise, current):
        return next_noise_rank(noise, 2, current, r_min=8, r_max=32, exponent=0.5, rank_step=4, multiple=2)

    assert step(8.0, 32) == 28  # 16 asked, 4 at most per window
    assert step(8.0, 18) == 16
    assert step(1000.0, 10) == 8  # 32 * sqrt(2/1000) = 1.4, floored at r_min
    assert step(1.0, 20) == 24  # signal-dominated again: back up, 4 at a time
    assert step(NAN, 20) == 20  # unknown: kept
    assert step(9.0, 16) == 16  # 15.08 rounds to 16


def test_warmup_ends_at_the_first_check_with_a_small_enough_error():
    gate = WarmupGate("gradient", warmup_steps=20, window=8, max_error=0.1, check_every=3)
    assert [gate.needs_errors(s) for s in range(1, 7)] == [False, False, True, False, False, True]
    assert not gate.update(1) and not gate.update(2)
    assert not gate.update(3, eps_rmin=0.5, eps_rmax=0.2)  # too large an error at r_max
    assert not gate.update(4, eps_rmax=0.01)  # not a check step: ignored
    assert not gate.update(6, eps_rmin=0.5, eps_rmax=NAN)  # not measured (a non-finite gradient)
    assert gate.update(9, eps_rmin=0.9, eps_rmax=0.1)  # at most max_error: opens (eps(r_min) plays no part)
    assert gate.update(10) and not gate.needs_errors(12)


def test_warmup_max_error_is_capped_by_warmup_steps():
    gate = WarmupGate("gradient", warmup_steps=7, window=8, max_error=1e-9, check_every=3)
    assert not gate.update(3, eps_rmax=0.5) and not gate.update(6, eps_rmax=0.5)
    assert gate.update(7) and not gate.needs_errors(9)
    assert not WarmupGate("gradient", warmup_steps=6, window=8, max_error=0.1, check_every=3).needs_errors(6)
    # the state holds whether a check passed and whether the gate is open
    assert gate.state_dict() == {"eps_max": None, "passed": False, "open": True}


def test_a_passed_check_waits_for_min_steps():
    gate = WarmupGate("gradient", warmup_steps=20, window=8, max_error=0.1, check_every=3, min_steps=7)
    assert not gate.update(3, eps_rmax=0.5)  # too large an error
    assert not gate.update(6, eps_rmax=0.05)  # passes, but before min_steps
    assert gate.state_dict() == {"eps_max": None, "passed": True, "open": False}
    assert not gate.needs_errors(9)  # passed: nothing more to measure
    restored = WarmupGate("gradient", 20, 8, 0.1, 3, min_steps=7)
    restored.load_state_dict(gate.state_dict())  # (a checkpoint between the check and the floor)
    assert restored.update(7) and gate.update(7)  # compression starts after step 7
    # a check passing after min_steps opens at once; warmup_steps still caps the warm-up
    late = WarmupGate("gradient", 20, 8, 0.1, 3, min_steps=7)
    assert not late.update(9, eps_rmax=0.2) and late.update(12, eps_rmax=0.1)
    assert WarmupGate("gradient", 7, 8, 1e-9, 3, min_steps=7).update(7)
    # a state saved before `passed` existed: an open gate stays open, a closed one checks again
    old = WarmupGate("gradient", 20, 8, 0.1, 3, min_steps=7)
    old.load_state_dict({"eps_max": None, "open": False})
    assert not old.passed and old.needs_errors(9)


def test_edgc_train_floors_the_warmup_at_the_learning_rates():
    assert TrainConfig(steps=1000).edgc_config().warmup_min_steps == 50  # steps // 20
    assert TrainConfig(steps=1000, lr_warmup_steps=30).edgc_config().warmup_min_steps == 30
    assert TrainConfig(steps=1000, lr_warmup_steps=500).edgc_config().warmup_min_steps == 100  # warmup_steps caps it
    assert TrainConfig(steps=1000, method="powersgd").edgc_config().warmup_min_steps == 50
    assert TrainConfig(steps=1000, edgc={"warmup_min_steps": 0}).edgc_config().warmup_min_steps == 0
    # a fixed warm-up (given, or a pipeline's) has no floor to set
    assert TrainConfig(steps=1000, edgc={"warmup": "fixed"}).edgc_config().warmup_min_steps == 0
    assert TrainConfig(steps=1000, pp=2, nproc=2).edgc_config().warmup_min_steps == 0
    assert EDGCConfig().warmup_min_steps == 0  # the library cannot know the learning rate's warm-up


@pytest.mark.parametrize("values, field", [
    (dict(warmup_min_steps=-1), "warmup_min_steps"),
    (dict(warmup_steps=10, warmup_min_steps=11), "warmup_min_steps"),
    (dict(warmup="fixed", warmup_min_steps=5), "warmup_min_steps"),  # (it would be ignored)
    (dict(noise_exponent=0.0), "noise.exponent"),
    (dict(noise_exponent=-1.0), "noise.exponent"),
    (dict(noise_exponent=4.5), "noise.exponent"),
    (dict(noise_exponent=NAN), "noise.exponent"),
    (dict(warmup_max_error=0.0), "warmup_max_error"),
    (dict(warmup_max_error=1.5), "warmup_max_error"),
    (dict(warmup_max_error=NAN), "warmup_max_error"),
    (dict(warmup_max_error=None), "warmup_max_error"),
    (dict(warmup="gradient", warmup_error_norm="l1"), "warmup_error_norm"),
    (dict(warmup="fixed", warmup_max_error=0.3), "warmup_max_error"),  # (it would be ignored)
])
def test_config_errors_name_the_field(values, field):
    with pytest.raises(ValueError, match=f"EDGCConfig.{field}="):
        EDGCConfig.from_dict(values)


def test_config_defaults():
    cfg = EDGCConfig(max_rank=32)
    assert (cfg.policy, cfg.noise.exponent, cfg.warmup, cfg.warmup_max_error) == ("noise", 0.35, "gradient", 0.1)
    assert cfg.long_rank_factor == 2.0
    assert EDGCConfig(warmup_max_error=1.0).warmup_max_error == 1.0


def test_the_default_is_noise_with_the_warmup_the_gradient_ends():
    assert (TrainConfig().edgc_config().policy, TrainConfig().edgc_config().warmup) == ("noise", "gradient")
    static = TrainConfig(method="powersgd").edgc_config()
    assert (static.policy, static.warmup, static.long_rank_factor) == ("static", "gradient", 1.0)
    assert TrainConfig(method="powersgd", edgc={"long_rank_factor": 3.0}).edgc_config().long_rank_factor == 3.0
    # the release's absolute error is read by the release's check only, and says so
    with pytest.raises(ValueError, match=r'EDGCConfig.warmup_error_norm=\'l1\': is read by warmup="release-check"'):
        EDGCConfig(warmup_error_norm="l1")
    assert EDGCConfig(warmup="release-check", warmup_error_norm="l1").warmup_error_norm == "l1"


def test_a_run_from_before_the_gradient_ended_warmup_resumes_with_its_fixed_warmup(tmp_path, as_edgc_0_1):
    # a run folder of edgc 0.1: its EDGCConfig flat, from before warmup_max_error existed
    old = TrainConfig(out=str(tmp_path), edgc={"policy": "cqm"}).resolve().to_dict()
    old["edgc"] = as_edgc_0_1(old["edgc"])
    del old["edgc"]["warmup_max_error"], old["edgc"]["noise_exponent"]  # (as runs were saved before them)
    save_checkpoint(tmp_path / "checkpoint.pt", {"step": 3, "train": old})
    resumed = resume_config(tmp_path / "checkpoint.pt", {}).edgc_config()
    assert (resumed.policy, resumed.warmup, resumed.noise.exponent) == ("cqm", "fixed", 0.5)
    new = TrainConfig(out=str(tmp_path)).resolve().to_dict()
    save_checkpoint(tmp_path / "checkpoint.pt", {"step": 3, "train": new})
    assert resume_config(tmp_path / "checkpoint.pt", {}).edgc_config().warmup == "gradient"
    # a section's option given on resume is compared in the flat form the command line uses
    resumed = resume_config(tmp_path / "checkpoint.pt", {"edgc": {"noise": {"exponent": 0.35}}})
    assert resumed.edgc_config().noise.exponent == 0.35
    with pytest.raises(ValueError, match="--edgc-noise-exponent 0.25"):
        resume_config(tmp_path / "checkpoint.pt", {"edgc": {"noise_exponent": 0.25}})


@pytest.mark.parametrize(("field", "today", "before"), [("warmup_min_steps", 50, 0), ("long_rank_factor", 2.0, 1.0)])
def test_a_run_saved_before_a_field_resumes_as_it_ran(tmp_path, field, today, before):
    saved = TrainConfig(out=str(tmp_path), steps=1000).resolve().to_dict()
    assert saved["edgc"][field] == today
    del saved["edgc"][field]  # (as runs were saved before the field)
    save_checkpoint(tmp_path / "checkpoint.pt", {"step": 3, "train": saved})
    assert getattr(resume_config(tmp_path / "checkpoint.pt", {}).edgc_config(), field) == before


def test_a_pipeline_keeps_the_fixed_warmup_and_refuses_the_gradient_ended_one(tmp_path, monkeypatch):
    # each stage measures its own gradient: the stages would end their warm-ups apart, and
    # the DAC's window-end exchange needs them all compressing
    from edgc.comm import EDGCState
    from edgc.comm.pipeline import StageAlignment

    monkeypatch.chdir(tmp_path)
    assert TrainConfig(pp=2, nproc=2).edgc_config().warmup == "fixed"
    assert TrainConfig(pp=2, nproc=2).edgc_config().policy == "noise"
    # one answer through both doors: edgc train's config, and a state given an alignment
    with pytest.raises(ValueError, match='warmup="gradient": a pipeline\'s stages would end the warm-up'):
        TrainConfig(pp=2, nproc=2, edgc={"warmup": "gradient"}).validate()
    with pytest.raises(ValueError, match='EDGCConfig.warmup="gradient": a pipeline\'s stages'):
        EDGCState(None, EDGCConfig(max_rank=4), alignment=StageAlignment(0, 2, None))
    EDGCState(None, EDGCConfig(max_rank=4, warmup="fixed"), alignment=StageAlignment(0, 2, None))
    with pytest.raises(ValueError, match="policy='schedule': does not take the DAC's stage alignment"):
        TrainConfig(pp=2, nproc=2, edgc={"policy": "schedule", "schedule_ranks": "0:4"}).validate()
    with pytest.raises(ValueError, match="policy='schedule': does not take the DAC's stage alignment"):
        EDGCState(None, EDGCConfig(max_rank=4, policy="schedule", schedule={"ranks": "0:4"}, warmup="fixed"),
                  alignment=StageAlignment(0, 2, None))


def test_the_long_rank_factor_may_not_change_on_resume(tmp_path):
    saved = TrainConfig(out=str(tmp_path), steps=1000, edgc={"long_rank_factor": 1.0}).resolve().to_dict()
    save_checkpoint(tmp_path / "checkpoint.pt", {"step": 3, "train": saved})
    with pytest.raises(ValueError, match="--edgc-long-rank-factor 2.0"):
        resume_config(tmp_path / "checkpoint.pt", {"edgc": {"long_rank_factor": 2.0}})
