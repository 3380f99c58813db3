import pytest

from edgc import EDGCConfig
from edgc.config import upgrade_config_v1
from edgc.policy.critical import CriticalConfig


@pytest.mark.parametrize(
    "field,value",
    [
        ("policy", "magic"),
        ("max_rank", 0),
        ("min_rank", -1),
        ("rank_step", 0),
        ("window", 0),
        ("iteration_sample_rate", 0.0),
        ("gradient_sample_rate", 1.5),
        ("entropy_estimator", "kde"),
        ("bins", 0),
        ("warmup_steps", -1),
        ("min_compression_rate", -2.0),
        ("cqm_method", "exact"),  # (the flat form of a section's field, as the command line gives it)
        ("warmup", "until-done"),
        ("use_error_feedback", "yes"),
        ("sync_mode", "async"),
        ("min_unit_mb", -0.5),
    ],
)
def test_invalid_value_names_the_field(field, value):
    section, _, option = field.partition("_")
    name = f"{section}.{option}" if section == "cqm" else field
    with pytest.raises(ValueError, match=rf"EDGCConfig\.{name}="):
        EDGCConfig.from_dict({field: value})


def test_min_rank_above_max_rank_is_rejected():
    with pytest.raises(ValueError, match="min_rank"):
        EDGCConfig(max_rank=8, min_rank=16)


def test_static_needs_a_rank():
    with pytest.raises(ValueError, match="max_rank"):
        EDGCConfig(policy="static")


def test_defaults_and_round_trip():
    cfg = EDGCConfig(max_rank=32)
    assert cfg.resolved_min_rank(32) == 8
    assert EDGCConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="no field"):
        EDGCConfig.from_dict({"rank": 3})


NAN, INF = float("nan"), float("inf")


def test_three_spellings_of_a_section_build_the_same_config():
    typed = EDGCConfig(policy="critical", max_rank=32, critical=CriticalConfig(threshold=0.3, low_rank=16))
    nested = EDGCConfig.from_dict({"policy": "critical", "max_rank": 32,
                                   "critical": {"threshold": 0.3, "low_rank": 16}})
    flat = EDGCConfig.from_dict({"policy": "critical", "max_rank": 32, "critical_threshold": 0.3,
                                 "critical_low_rank": 16})
    assert typed == nested == flat
    assert EDGCConfig.from_dict(typed.to_flat()) == EDGCConfig.from_dict(typed.to_dict()) == typed
    assert typed.to_flat()["critical_threshold"] == 0.3 and typed.to_dict()["critical"]["threshold"] == 0.3
    # a flat key wins over its section's table
    assert EDGCConfig.from_dict({"noise": {"exponent": 0.25}, "noise_exponent": 0.75}).noise.exponent == 0.75


def test_a_section_refuses_unknown_options_and_other_types():
    with pytest.raises(ValueError, match=r"EDGCConfig.noise has no field\(s\) \['gamma'\]"):
        EDGCConfig(noise={"gamma": 0.5})
    with pytest.raises(ValueError, match="EDGCConfig has no field"):
        EDGCConfig.from_dict({"noise_gamma": 0.5})
    with pytest.raises(ValueError, match="EDGCConfig.noise=3: must be a NoiseConfig"):
        EDGCConfig(noise=3)


@pytest.mark.parametrize("policy", ["budget", "spectral"])
def test_a_removed_policy_is_refused_with_the_reason(policy):
    with pytest.raises(ValueError, match=f"EDGCConfig.policy='{policy}': removed in edgc 0.2.0"):
        EDGCConfig(policy=policy)


@pytest.mark.parametrize("v1, mode, max_error", [
    ({}, "fixed", 0.1),  # (saved before the gradient-ended warm-up existed: it ran fixed)
    ({"warmup_max_error": None, "warmup_error_check": False}, "fixed", 0.1),
    ({"warmup_max_error": None, "warmup_error_check": True}, "release-check", 0.1),
    ({"warmup_max_error": 0.3, "warmup_error_check": False}, "gradient", 0.3),
])
def test_a_config_of_edgc_0_1_upgrades_to_the_warmup_it_ran(v1, mode, max_error):
    old = {"policy": "cqm", "max_rank": 8, "entropy_smoothing": 0.5, "lr_drop_factor": 0.25, "rank_schedule": "",
           "error_budget": 0.05, "spectral_headroom": 1.5, **v1}
    new = EDGCConfig.from_dict(upgrade_config_v1(old))
    assert (new.warmup, new.warmup_max_error) == (mode, max_error)
    assert (new.cqm.smoothing, new.critical.lr_drop_factor, new.sync_mode) == (0.5, 0.25, "whole-step")


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("bins", 10**12, r"EDGCConfig.bins=1000000000000: must be an integer in \[1, 1048576\]"),
        ("iteration_sample_rate", 1e-9, r"iteration_sample_rate=1e-09: must be in \[1e-06, 1\]"),
        ("gradient_sample_rate", 5e-324, r"gradient_sample_rate=5e-324: must be in \[1e-06, 1\]"),
        ("max_rank", 10**9, r"max_rank=1000000000: must be an integer in \[1, 65536\] or None"),
        ("min_rank", 2**16 + 1, r"min_rank=65537: must be an integer in \[1, 65536\]"),
        ("rank_step", 10**9, r"rank_step=1000000000: must be an integer in \[1, 65536\]"),
        ("calibration_repeats", 101, r"calibration_repeats=101: must be an integer in \[1, 100\]"),
        ("seed", -1, r"seed=-1: must be an integer in \[0, 2\*\*32\)"),
        ("seed", 2**32, r"seed=4294967296: must be an integer in \[0, 2\*\*32\)"),
        ("min_compression_rate", NAN, "min_compression_rate=nan: must be a finite number"),
        ("min_compression_rate", INF, "min_compression_rate=inf: must be a finite number"),
        ("min_unit_mb", NAN, "min_unit_mb=nan: must be a finite number"),
        ("min_unit_mb", INF, "min_unit_mb=inf: must be a finite number"),
        ("min_unit_mb", -1e-9, r"min_unit_mb=-1e-09: must be a non-negative number \(MB\)"),
        ("noise_exponent", NAN, "noise.exponent=nan: must be a finite number"),
        ("cqm_smoothing", -INF, "cqm.smoothing=-inf: must be a finite number"),
        ("window", True, "window=True: must be an integer, not true or false"),
        ("warmup_steps", 2**63, r"warmup_steps=9223372036854775808: must be an integer in \[-2\*\*63, 2\*\*63\)"),
        ("max_rank", 8.0, "max_rank=8.0: must be an integer or null"),
        ("critical_threshold", "2", "critical.threshold='2': must be a finite number"),
        ("policy", None, "policy=None: must be text"),
        ("warm_start", 1, "warm_start=1: must be true or false"),
        ("schedule_ranks", "abc", "schedule.ranks='abc': rank schedule knot 'abc' is not STEP:RANK"),
        ("warmup_max_error", None, 'warmup_max_error=None: must be a number in \\(0, 1\\]; for a fixed warm-up set '
                                   'warmup="fixed"'),
        ("warmup_error_norm", "l1", 'warmup_error_norm=\'l1\': is read by warmup="release-check" only'),
    ],
)
def test_types_bounds_and_finite_numbers(field, value, message):
    with pytest.raises(ValueError, match=message):
        EDGCConfig.from_dict({field: value})


def test_bounds_are_inclusive():
    cfg = EDGCConfig(bins=2**20, iteration_sample_rate=1e-6, gradient_sample_rate=1e-6, max_rank=2**16,
                     calibration_repeats=100, seed=2**32 - 1, min_compression_rate=0, cqm={"smoothing": 0},
                     min_unit_mb=0)
    assert cfg.bins == 2**20 and cfg.max_rank == 65536


@pytest.mark.parametrize(
    "values,message",
    [
        ({"eta": NAN}, "dac eta=nan: must be a finite number or null"),
        ({"t_mb": -1.0}, "dac t_mb=-1.0: must be a finite number >= 0"),
        ({"intercept": INF}, "dac intercept=inf: must be a finite number"),
        ({"multiple": True}, "dac multiple=True: must be an integer, not true or false"),
        ({"multiple": 10**9}, r"dac multiple=1000000000: must be an integer in \[1, 65536\]"),
        ({"cap_at_r_max": "yes"}, "dac cap_at_r_max='yes': must be true or false"),
        ({"slack": "later"}, r"dac slack='later': must be one of \('t_mb', 'measured'\)"),
    ],
)
def test_dac_config_types(values, message):
    from edgc.policy.dac import DACConfig

    with pytest.raises(ValueError, match=message):
        DACConfig.from_dict(values)
    assert DACConfig.from_dict({"eta": 0, "intercept": -1, "t_mb": None}).eta == 0


@pytest.mark.parametrize(
    "values,message",
    [
        ({"steps": True}, "steps=True: must be an integer, not true or false"),
        ({"lr": NAN}, "lr=nan: must be a finite number"),
        ({"lr": INF}, "lr=inf: must be a finite number"),
        ({"grad_clip": NAN}, "grad_clip=nan: must be a finite number"),
        ({"weight_decay": -5.0}, r"weight_decay=-5.0: must be >= 0"),
        ({"bucket_cap_mb": 0.0}, r"bucket_cap_mb=0.0: must be in \(0, 1048576\]"),
        ({"bucket_cap_mb": -1}, r"bucket_cap_mb=-1: must be in \(0, 1048576\]"),
        ({"bucket_cap_mb": 1e12}, r"bucket_cap_mb=1000000000000.0: must be in \(0, 1048576\]"),
        ({"out": 2024}, "out=2024: must be text"),
        ({"out": ""}, "out='': must name a folder"),
        ({"edgc": 5}, "edgc=5: must be a table of options"),
        ({"stop_after": 0}, r"stop_after=0: must be a positive integer or null \(unset\)"),
        ({"lr_warmup_steps": -1}, r"lr_warmup_steps=-1: must be an integer >= 0 or null"),
        ({"rank": 2**16 + 1}, "rank=65537: must be at most 65536"),
        ({"seed": 2**32}, r"seed=4294967296: must be an integer in \[0, 2\*\*32\)"),
        ({"microbatches": 4}, "microbatches=4: splits a pipeline's step: it needs pp > 1"),
        ({"edgc": {"bins": 10**12}}, "EDGCConfig.bins=1000000000000"),
        ({"dac": {"eta": INF}}, "dac eta=inf"),
    ],
)
def test_train_config_types_and_bounds(values, message):
    from edgc.train.config import TrainConfig

    with pytest.raises(ValueError, match=message):
        TrainConfig.from_dict(values).validate()


def test_train_config_from_dict_checks_types_before_anything_reads_them():
    # (the trainer compares pp > 1 before validate() runs: text there must not get that far)
    from edgc.train.config import TrainConfig

    with pytest.raises(ValueError, match="pp='2': must be an integer"):
        TrainConfig.from_dict({"pp": "2"})
    assert TrainConfig.from_dict({"lr": 1, "stop_after": None}).lr == 1
