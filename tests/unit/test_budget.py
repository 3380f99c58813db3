"""The error-budget policy's rank rule, as a pure function."""

import math

from edgc.policy.budget import budget_rank, equivalent_rank


def test_rank_grows_when_more_than_the_budget_is_left_out_and_shrinks_when_less():
    assert budget_rank(16, 0.10, 0.05, r_min=2, r_max=64, multiple=2) == 26  # 16 * 2^0.7 = 25.99
    assert budget_rank(16, 0.025, 0.05, r_min=2, r_max=64, multiple=2) == 10  # 16 / 2^0.7 = 9.85
    assert budget_rank(16, 0.05, 0.05, r_min=2, r_max=64, multiple=2) == 16  # on budget: holds


def test_moves_are_clipped_to_a_factor_of_two_and_to_the_bounds():
    assert budget_rank(16, 0.9, 0.01, r_min=2, r_max=64, multiple=2) == 32
    assert budget_rank(16, 0.0, 0.05, r_min=2, r_max=64, multiple=2) == 8
    assert budget_rank(48, 0.9, 0.01, r_min=2, r_max=64, multiple=2) == 64
    assert budget_rank(4, 0.0, 0.05, r_min=4, r_max=64, multiple=2) == 4
    assert budget_rank(16, math.nan, 0.05, r_min=2, r_max=64, multiple=2) == 16


def test_ranks_below_one_multiple_round_to_whole_ranks():
    assert budget_rank(2, 0.06, 0.05, r_min=1, r_max=64, multiple=4) == 2
    assert budget_rank(2, 0.2, 0.05, r_min=1, r_max=64, multiple=4) == 4
    assert budget_rank(3, 0.0, 0.05, r_min=1, r_max=64, multiple=4) == 2


def test_equivalent_rank_weighs_groups_by_their_bytes_per_rank():
    assert equivalent_rank([8, 32], [100, 300]) == 26.0
    assert equivalent_rank([], []) == 0.0
