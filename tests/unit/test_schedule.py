"""The fixed rank schedule's knots, and the choice of process-group backend per machine."""

import pytest

from edgc.policy.schedule import parse_rank_schedule, scheduled_rank
from edgc.train.config import process_group_backend


def test_knots_parse_and_the_rank_steps_at_each():
    knots = parse_rank_schedule(" 0:32, 300:16 ,700:8")
    assert knots == [(0, 32), (300, 16), (700, 8)]
    assert [scheduled_rank(knots, s) for s in (1, 299, 300, 699, 700, 10**6)] == [32, 32, 16, 16, 8, 8]
    assert scheduled_rank(parse_rank_schedule("100:8"), 5) == 8  # before the first knot: its rank


@pytest.mark.parametrize("text, message", [("", "at least one knot"), ("0:8,0:4", "must increase"),
                                           ("10:8,5:4", "must increase"), ("0:0", "rank >= 1"),
                                           ("-1:4", "step must be >= 0"), ("0-8", "STEP:RANK"), ("a:b", "STEP:RANK")])
def test_bad_schedules_are_refused_with_the_reason(text, message):
    with pytest.raises(ValueError, match=message):
        parse_rank_schedule(text)


def test_nccl_only_where_every_local_worker_has_its_own_gpu():
    assert process_group_backend("cuda", 2, 2) == "nccl"
    assert process_group_backend("cuda", 2, 1) == "gloo"  # two workers on one GPU: NCCL would refuse
    assert process_group_backend("cpu", 1, 8) == "gloo"
