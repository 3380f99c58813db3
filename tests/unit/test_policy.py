"""Rank policies as pure objects: window, bounds, rate limit, warm-up, calibration."""

import math

import pytest

from edgc.config import EDGCConfig
from edgc.policy import (
    EntropyWindow,
    ErrorModel,
    WarmupGate,
    WindowEnd,
    calibrated_max_rank,
    limit_rank,
    linear_rank,
    make_policy,
    probe_ranks,
)

SHAPES = [(256, 1024)] * 4 + [(1024, 256)] * 4


class Driver:
    """A policy fed the entropy window by window, as the synchroniser feeds it."""

    def __init__(self, policy, r_min=8, r_max=32, step=4, smoothing=0.0, started=True):
        config = EDGCConfig(policy=policy, max_rank=r_max, min_rank=r_min, rank_step=step, cqm={"smoothing": smoothing})
        self.policy, self.window, self.r_min, self.r_max = make_policy(config), EntropyWindow(), r_min, r_max
        if started:
            self.start()

    def start(self, mid_window=False):
        self.policy.start(self.r_min, self.r_max, step=0, windows_closed=len(self.window.history),
                          mid_window=mid_window)
        self.policy.bind_shapes(SHAPES)

    def observe(self, h):
        self.window.observe(h)

    def close_window(self):
        return self.window.close()

    def decide(self):
        end = WindowEnd(step=0, compressing=True, rank=self.policy.rank, r_min=self.r_min, r_max=self.r_max,
                        replicas=1, history=tuple(self.window.history))
        return self.policy.decide(end)

    @property
    def rank(self):
        return self.policy.rank

    @property
    def history(self):
        return self.window.history


def _controller(policy, r_min=8, r_max=32, step=4):
    return Driver(policy, r_min, r_max, step)


def _feed(c, *means):
    for h in means:
        c.observe(h)
        c.close_window()


def test_cqm_rank_falls_when_entropy_falls_and_rises_when_it_rises():
    c = _controller("cqm", step=32)
    _feed(c, -5.0, -5.2)
    down = c.decide()
    assert down < 32
    _feed(c, -4.9)
    assert c.decide() > down


def test_rate_limit_holds_from_the_first_move_and_bounds():
    c = _controller("cqm", r_min=8, r_max=32, step=4)
    _feed(c, -5.0, -8.0)  # a huge fall: the first move is limited too, as in the release
    assert c.decide() == 28
    for _ in range(10):
        _feed(c, c.history[-1] - 3.0)
        c.decide()
    assert c.rank == 8  # never below r_min
    _feed(c, 0.0)  # a huge rise: limited to +4 per window
    assert c.decide() == 12
    _feed(c, 5.0)
    assert c.decide() == 16
    for _ in range(10):
        _feed(c, c.history[-1] + 5.0)
        c.decide()
    assert c.rank == 32  # never above r_max


def test_window_mean_ignores_nonfinite_and_empty_windows_keep_rank():
    c = _controller("cqm")
    c.observe(1.0)
    c.observe(float("nan"))
    c.observe(3.0)
    assert c.close_window() == 2.0
    assert math.isnan(c.close_window())  # no samples
    assert c.decide() == 32  # nothing to compare: unchanged


def test_static_policy_never_moves():
    c = _controller("static")
    _feed(c, -1.0, -9.0, 4.0)
    assert c.decide() == 32


def test_linear_rule_matches_release_formula():
    assert linear_rank(0.5, 1.0, 8, 32) == 20.0
    assert linear_rank(3.0, 1.0, 8, 32) == 32.0
    assert linear_rank(0.0, 1.0, 8, 32) == 8.0
    assert linear_rank(0.1, 0.0, 8, 32) == 32.0  # release bug guard: zero reference
    c = _controller("linear", step=100)
    _feed(c, 1.0, 2.0, 2.25)  # ref |1-2| = 1, current 0.25 -> 8 + 24 * 0.25 = 14
    assert c.decide() == 14


def test_limit_rank_rounds_to_multiple_inside_bounds():
    assert limit_rank(13.2, 20, r_min=4, r_max=32, step=None, multiple=4) == 12
    assert limit_rank(1.0, 20, r_min=4, r_max=32, step=None, multiple=4) == 4
    assert limit_rank(31.0, 20, r_min=4, r_max=30, step=None, multiple=4) == 30
    assert limit_rank(2.0, 20, r_min=4, r_max=32, step=6, multiple=2) == 14
    assert limit_rank(float("nan"), 20, r_min=4, r_max=32, step=6, multiple=2) == 20


@pytest.mark.parametrize("policy", ["linear", "cqm"])
def test_policy_and_entropy_window_state_round_trip(policy):
    c = _controller(policy, step=32)
    _feed(c, 1.0, 2.0)
    c.decide()
    c.observe(7.0)
    d = _controller(policy)
    d.policy.load_state_dict(c.policy.state_dict())
    d.window.load_state_dict(c.window.state_dict())
    assert d.policy.state_dict() == c.policy.state_dict() and d.window.state_dict() == c.window.state_dict()
    _feed(c, 1.5)
    _feed(d, 1.5)
    assert d.decide() == c.decide()


def test_warmup_floor_without_error_check():
    gate = WarmupGate("fixed", warmup_steps=10, window=4)
    assert [gate.update(s) for s in range(1, 12)] == [False] * 9 + [True, True]


def test_warmup_error_check_triggers_as_specified():
    gate = WarmupGate("release-check", warmup_steps=10, window=4)
    assert not gate.needs_errors(3) and gate.needs_errors(4)
    assert not gate.update(4, eps_rmin=0.9, eps_rmax=0.5)  # records eps_max = 0.5
    assert gate.eps_max == 0.5
    assert not gate.update(8, eps_rmin=0.4, eps_rmax=0.2)  # below eps_max but before the floor
    assert not gate.update(9)  # not a window end
    assert not gate.update(12, eps_rmin=0.6, eps_rmax=0.3)  # past the floor, error too high
    assert gate.update(16, eps_rmin=0.45, eps_rmax=0.2)  # first window with eps(r_min) < eps_max
    assert gate.update(17) and not gate.needs_errors(20)


def test_calibration_interpolates_crossing_and_floors_to_four():
    points = [(2, 0.1), (4, 0.2), (8, 0.4), (16, 0.8), (32, 1.6)]
    # uncompressed 1.0 s: crossing between 16 (0.8) and 32 (1.6) at 20 -> 20
    assert calibrated_max_rank(points[:], 1.0) == 20
    assert calibrated_max_rank(points[:], 1.1) == 20  # 22 floored to a multiple of 4
    assert calibrated_max_rank(points[:4], 5.0) == 16  # never crossed: largest probed
    assert calibrated_max_rank([(2, 1.0)], 0.5) == 4  # never pays: the floor
    with pytest.raises(ValueError):
        calibrated_max_rank([], 1.0)


def test_probe_ranks_double_up_to_cap():
    assert probe_ranks(20) == [2, 4, 8, 16, 20]
    assert probe_ranks(16) == [2, 4, 8, 16]
    assert probe_ranks(1) == [1]


def test_cqm_ignores_windows_closed_during_warmup():
    c = Driver("cqm", step=4, started=False)
    c.observe(-4.0)
    c.close_window()  # a warm-up window with much higher entropy
    c.start()
    _feed(c, -6.0)
    assert c.decide() == 32  # one comparable window only: no move yet
    _feed(c, -6.0)
    assert c.decide() == 32  # equal entropy after warm-up: rank holds


def test_cqm_keeps_a_continuous_rank_so_slow_drifts_add_up():
    # each window's fall moves the mapped rank by less than half a rounding step
    c = _controller("cqm", r_min=8, r_max=32, step=4)
    _feed(c, -5.0)
    model = ErrorModel(SHAPES)
    h = -5.0
    for _ in range(12):
        h -= 0.002
        _feed(c, h)
        c.decide()
    assert c.rank < 32, "a drift made of sub-rounding moves must add up"
    assert c.policy.rank_value < 31.0
    # what a rank rounded every window would do: stay at 32
    from edgc.policy.cqm import cqm_rank
    assert round(cqm_rank(-5.0, -5.002, 32.0, model) / 2) * 2 == 32


def test_first_compared_window_holds_no_warmup_step():
    c = Driver("cqm", step=32, started=False)
    c.observe(-4.0)
    c.close_window()  # a warm-up window
    c.observe(-4.0)  # warm-up samples in the window still open when compression starts
    c.start(mid_window=True)
    c.observe(-6.0)
    c.close_window()  # mixed window: not compared
    _feed(c, -6.0)
    assert c.decide() == 32  # one clean window only
    _feed(c, -6.0)
    assert c.decide() == 32  # equal entropy across clean windows: rank holds


def test_smoothing_damps_a_one_window_blip():
    raw, smooth = _controller("cqm", step=32), Driver("cqm", step=32, smoothing=0.8)
    for c in (raw, smooth):
        _feed(c, -5.0, -5.0, -5.3)  # a noisy window
        c.decide()
    assert raw.rank < smooth.rank <= 32
    assert smooth.policy.compared(smooth.history)[-1] == pytest.approx(0.8 * -5.0 + 0.2 * -5.3)
