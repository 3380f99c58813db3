"""Long matrices (the token embedding's shape) compress at EDGCConfig.long_rank_factor
times the policy's rank: the rule, the hook's groups as the rank moves, the float64
error-feedback invariant with two ranks in one step, and the config's checks."""

import pytest
import torch

from edgc import EDGCConfig, EDGCState, edgc_hook
from edgc.comm.buckets import FlatBucket
from edgc.compress import LONG_ASPECT, matrix_rank
from edgc.config import ADDED_FIELDS, upgrade_config_v1, with_added_fields

# slot 0: long ((96, 12): 8 times as long as wide, at least LONG_ASPECT); 1-2: (12, 10); 3: a bias
SHAPES = [(96, 12), (12, 10), (12, 10), (10,)]


def test_the_rule_doubles_long_matrices_only_and_caps_by_the_matrix():
    assert LONG_ASPECT == 5
    assert matrix_rank((2048, 128), 20, 2.0, 2) == 40  # GPT-2's token embedding, either way round
    assert matrix_rank((128, 2048), 20, 2.0, 2) == 40
    assert matrix_rank((512, 128), 20, 2.0, 2) == 20  # an MLP matrix (4x): the policy's rank
    assert matrix_rank((79, 16), 6, 2.0, 2) == 6  # (just under 5x)
    assert matrix_rank((80, 16), 6, 2.0, 2) == 12
    assert matrix_rank((2048, 384), 20, 2.0, 2) == 40  # the `small` preset's embedding (5.3x)
    assert matrix_rank((2048, 128), 20, 1.0, 2) == 20  # 1: PowerSGD's one rank
    assert matrix_rank((2048, 128), 100, 2.0, 2) == 128  # capped by the shorter side
    assert matrix_rank((2048, 128), 5, 1.5, 2) == 6  # 7.5 -> 7 -> rounded down to the multiple
    assert matrix_rank((2048, 128), 5, 1.5, 1) == 7
    assert matrix_rank((2048, 128), 3, 0.25, 2) == 1  # never below 1
    assert matrix_rank((12, 10), 40, 2.0, 2) == 10


def _run(steps_wanted, **config):
    """One replica, one bucket a step, float64 gradients; returns per step the groups'
    ranks, the gradients in and out, and each slot's error feedback before and after."""
    params = [torch.nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in SHAPES]
    cfg = dict(policy="schedule", max_rank=4, schedule={"ranks": "0:4,4:2"}, warmup="fixed", warmup_steps=1,
               min_compression_rate=1.0, wire="native", rank_multiple=1)
    state = EDGCState(None, EDGCConfig(**{**cfg, **config}))
    gen = torch.Generator().manual_seed(0)

    def errors():
        return {s: g.error[i].clone() for g in state.sync.compression.groups.values() for i, s in enumerate(g.slots)}

    steps = []
    for _ in range(steps_wanted):
        grads = [torch.randn(s, dtype=torch.float64, generator=gen) for s in SHAPES]
        before = errors()
        flat = torch.cat([g.reshape(-1) for g in grads])
        out = edgc_hook(state, FlatBucket(0, flat, params, True)).wait()
        got = [g.clone() for g in FlatBucket(0, out, params, True).gradients()]
        ranks = {g.shape: g.q.shape[-1] for g in state.sync.compression.groups.values()}
        steps.append((ranks, grads, got, before, errors()))
    return steps


def test_the_hook_keeps_the_long_group_at_twice_the_rank_as_the_rank_moves():
    seen = [ranks for ranks, *_ in _run(6)]
    # warm-up (step 1), then rank 4 (the long group 8) and from step 4 rank 2 (the long group 4)
    assert seen[0] == seen[2] == {(96, 12): 8, (12, 10): 4}
    assert seen[3] == seen[5] == {(96, 12): 4, (12, 10): 2}
    flat = [ranks for ranks, *_ in _run(6, long_rank_factor=1.0)]
    assert flat[0] == {(96, 12): 4, (12, 10): 4} and flat[5] == {(96, 12): 2, (12, 10): 2}


def test_sent_plus_kept_equals_the_input_with_two_ranks_in_a_step():
    steps = _run(6)
    for _, grads, out, before, after in steps:
        assert sorted(after) == [0, 1, 2]  # (the groups exist from the end of step 1 on)
        for s in after:
            # one replica: the average is what was sent; the error feedback keeps the rest
            torch.testing.assert_close(out[s] + after[s], grads[s] + before.get(s, 0), rtol=0, atol=1e-12)
        torch.testing.assert_close(out[3], grads[3], rtol=0, atol=0)  # the bias travels whole
    # the long matrix's reconstruction has rank 8 while the rank is 4: more than the others'
    out = steps[2][2]
    assert torch.linalg.matrix_rank(out[0]).item() == 8
    assert torch.linalg.matrix_rank(out[1]).item() == 4


def test_bad_factors_are_refused_by_name():
    for bad in (0, -1.0, 16.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"EDGCConfig.long_rank_factor="):
            EDGCConfig(long_rank_factor=bad)
    with pytest.raises(ValueError, match=r"EDGCConfig.long_rank_factor="):
        EDGCConfig(long_rank_factor=True)
    assert EDGCConfig(long_rank_factor=16).long_rank_factor == 16


def test_a_config_saved_before_the_field_runs_at_one_rank():
    saved = EDGCConfig().to_dict()
    del saved["long_rank_factor"]  # (as configs were saved before it)
    assert ADDED_FIELDS["long_rank_factor"] == 1.0
    assert EDGCConfig.from_dict(with_added_fields(saved)).long_rank_factor == 1.0
    assert EDGCConfig.from_dict(with_added_fields({**saved, "long_rank_factor": 3.0})).long_rank_factor == 3.0
    assert EDGCConfig().long_rank_factor == 2.0
    # edgc 0.1's flat configs too
    v1 = {"policy": "static", "max_rank": 4, "warmup_error_check": False, "warmup_max_error": None}
    assert upgrade_config_v1(v1)["long_rank_factor"] == 1.0
