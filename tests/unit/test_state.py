"""EDGCState outside a process group: config checks and state-dict validation."""

import pytest

from edgc import EDGCConfig, EDGCState


def test_state_requires_config_type():
    with pytest.raises(TypeError, match="EDGCConfig"):
        EDGCState(None, {"policy": "cqm"})


def test_fresh_stats():
    s = EDGCState(None, EDGCConfig(max_rank=8)).stats()
    assert (s.step, s.phase, s.rank, s.max_rank, s.min_rank) == (0, "warmup", 0, 8, 2)
    assert s.bytes_sent == 0 and s.compression_ratio == 1.0


def test_load_rejects_other_world_size_and_foreign_dicts():
    state = EDGCState(None, EDGCConfig(max_rank=8))
    saved = state.state_dict()
    with pytest.raises(ValueError, match="world size 4"):
        EDGCState(None, EDGCConfig(max_rank=8)).load_state_dict({**saved, "world_size": 4})
    with pytest.raises(ValueError, match="not an EDGC state"):
        EDGCState(None, EDGCConfig(max_rank=8)).load_state_dict({"error_dict": {}})
    with pytest.raises(ValueError, match="version"):
        EDGCState(None, EDGCConfig(max_rank=8)).load_state_dict({**saved, "version": 99})


def test_state_round_trip_before_training():
    a = EDGCState(None, EDGCConfig(max_rank=8, seed=3))
    b = EDGCState(None, EDGCConfig(max_rank=8, seed=3))
    b.load_state_dict(a.state_dict())
    assert b.stats() == a.stats()
