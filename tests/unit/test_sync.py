"""The compression core's pieces that adapters lean on: declared slots, the eager mode's
refusals, and the warm-up check's sums taken a few matrices at a time."""

import pickle

import pytest
import torch

from edgc import EDGCConfig
from edgc.comm.sync import GradientSync
from edgc.compress import lowrank_error_sums, lowrank_errors_from_sums, lowrank_l1_error, relative_lowrank_error


def test_error_sums_add_up_over_pieces_to_the_whole():
    g = torch.Generator().manual_seed(0)
    mats = [torch.randn(7, 5, generator=g, dtype=torch.float64) for _ in range(4)]
    for norm, whole in (("relative", relative_lowrank_error), ("l1", lowrank_l1_error)):
        a, b = lowrank_error_sums(mats[:1], [1, 3], norm), lowrank_error_sums(mats[1:], [1, 3], norm)
        summed = [x + y for x, y in zip(a, b, strict=True)]
        assert lowrank_errors_from_sums(summed, norm) == pytest.approx(whole(mats, [1, 3]), rel=1e-12)
    whole = relative_lowrank_error(mats, [1, 3])
    assert lowrank_errors_from_sums(lowrank_error_sums(mats, [1, 3]), "relative") == whole
    assert all(x != x for x in lowrank_errors_from_sums(lowrank_error_sums([], [1, 3])))  # no matrices: nan
    with pytest.raises(ValueError, match="norm"):
        lowrank_error_sums(mats, [1], "max")


def test_declared_slots_are_fixed_and_checked():
    sync = GradientSync(None, EDGCConfig(max_rank=4), eager=True)
    sync.declare([[("a", (4, 3)), ("b", (3,))], [("c", (5, 2))]], [torch.float32, torch.float32])
    assert sync.compression.slot_shapes == [(4, 3), (3,), (5, 2)]
    with pytest.raises(RuntimeError, match="declared"):
        sync.declare([[("d", (2, 2))]], [torch.float32])
    with pytest.raises(ValueError, match="dtypes"):
        GradientSync(None, EDGCConfig(max_rank=4), eager=True).declare([[("a", (2, 2))]], [])


def test_eager_mode_refuses_calibration_alignment_and_pickling():
    with pytest.raises(ValueError, match="max_rank"):
        GradientSync(None, EDGCConfig(max_rank=None), eager=True)
    with pytest.raises(ValueError, match="alignment"):
        GradientSync(None, EDGCConfig(max_rank=4), eager=True, alignment=object())
    with pytest.raises(TypeError, match="state_dict"):
        pickle.dumps(GradientSync(None, EDGCConfig(max_rank=4), eager=True))


def test_a_state_of_other_tensors_is_refused_when_loaded():
    saved = GradientSync(None, EDGCConfig(max_rank=4), eager=True)
    saved.declare([[("a", (4, 3)), ("b", (3,))]], [torch.float32])
    other = GradientSync(None, EDGCConfig(max_rank=4), eager=True)
    other.declare([[("a", (5, 3)), ("b", (3,))]], [torch.float32])
    with pytest.raises(ValueError, match="does not match this model"):
        other.load_state_dict(saved.state_dict())
    same = GradientSync(None, EDGCConfig(max_rank=4), eager=True)
    same.declare([[("a", (4, 3)), ("b", (3,))]], [torch.float32])
    same.load_state_dict(saved.state_dict())  # (the same layout loads)
