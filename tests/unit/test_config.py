import pytest

from edgc import EDGCConfig


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
        ("cqm_method", "exact"),
        ("use_error_feedback", "yes"),
    ],
)
def test_invalid_value_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        EDGCConfig(**{field: value})


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
