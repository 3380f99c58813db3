"""EDGCState outside a job of several processes: config checks, state-dict validation, and
binding its process group at the first step."""

import pickle

import pytest
import torch
import torch.distributed as dist

from edgc import EDGCConfig, EDGCState, edgc_hook
from edgc.comm.buckets import FlatBucket


def test_state_requires_config_type():
    with pytest.raises(TypeError, match="EDGCConfig"):
        EDGCState(None, {"policy": "cqm"})


def test_fresh_stats():
    s = EDGCState(None, EDGCConfig(max_rank=8)).stats()
    assert (s.step, s.phase, s.rank, s.max_rank, s.min_rank) == (0, "warmup", 0, 8, 2)
    assert (s.step_phase, s.step_rank) == ("warmup", 0)
    assert s.bytes_sent == 0 and s.compression_ratio == 1.0


def test_load_rejects_foreign_dicts():
    saved = EDGCState(None, EDGCConfig(max_rank=8)).state_dict()
    with pytest.raises(ValueError, match="not an EDGC state"):
        EDGCState(None, EDGCConfig(max_rank=8)).load_state_dict({"error_dict": {}})
    with pytest.raises(ValueError, match="version"):
        EDGCState(None, EDGCConfig(max_rank=8)).load_state_dict({**saved, "version": 99})


def test_load_rejects_other_world_size_once_the_group_exists(one_process_group):
    saved = EDGCState(None, EDGCConfig(max_rank=8)).state_dict()
    assert (saved["world_size"], saved["replica"]) == (1, 0)
    with pytest.raises(ValueError, match="world size 4"):
        EDGCState(None, EDGCConfig(max_rank=8)).load_state_dict({**saved, "world_size": 4})
    with pytest.raises(ValueError, match="saved by replica 3"):
        EDGCState(None, EDGCConfig(max_rank=8)).load_state_dict({**saved, "replica": 3})


def test_load_before_the_group_is_checked_at_the_first_step(tmp_path):
    saved = EDGCState(None, EDGCConfig(max_rank=8)).state_dict()
    state = EDGCState(None, EDGCConfig(max_rank=8))
    state.load_state_dict({**saved, "world_size": 4})  # no group yet: nothing to compare with
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        grad = torch.zeros(6)
        bucket = FlatBucket(0, grad, [torch.nn.Parameter(torch.zeros(6))], True)
        with pytest.raises(ValueError, match="world size 4 but this job has 1"):
            edgc_hook(state, bucket)
    finally:
        dist.destroy_process_group()


def test_hook_without_a_group_in_a_multi_process_job_raises(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    state = EDGCState(None, EDGCConfig(max_rank=8))
    bucket = FlatBucket(0, torch.zeros(6), [torch.nn.Parameter(torch.zeros(6))], True)
    with pytest.raises(RuntimeError, match="before torch.distributed was initialised.*WORLD_SIZE=2"):
        edgc_hook(state, bucket)


def test_state_round_trip_before_training():
    a = EDGCState(None, EDGCConfig(max_rank=8, seed=3))
    b = EDGCState(None, EDGCConfig(max_rank=8, seed=3))
    b.load_state_dict(a.state_dict())
    assert b.stats() == a.stats()


def test_pickle_keeps_config_and_loaded_state():
    a = EDGCState(None, EDGCConfig(max_rank=8, seed=3))
    b = pickle.loads(pickle.dumps(a))
    assert b.config == a.config and b.process_group is None and b.stats() == a.stats()
    saved = a.state_dict()
    c = EDGCState(None, EDGCConfig(max_rank=8, seed=3))
    c.load_state_dict(saved)
    d = pickle.loads(pickle.dumps(c))
    assert d.state_dict()["compression"]["generator"].equal(saved["compression"]["generator"])


def test_grad_scale_must_be_positive_and_finite():
    state = EDGCState(None, EDGCConfig(max_rank=8))
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="grad scale"):
            state.set_grad_scale(bad)
    state.set_grad_scale(1024)
    assert state.sync.grad_scale == 1024.0
