"""EDGCConfig(total_steps=N): the run-length defaults scaled to an N-step run by the rule
`edgc train` uses (edgc.config.run_scaled), what is given kept, and without it one warning at
the first compressed step."""

import dataclasses
import logging

import pytest
import torch

from edgc import EDGCConfig, EDGCState, edgc_hook
from edgc.comm.buckets import sync_with_hook
from edgc.config import RUN_SCALED, run_scaled
from edgc.train.config import TrainConfig


def test_a_5000_step_run_gets_a_window_and_warm_up_of_its_length():
    c = EDGCConfig(max_rank=32, total_steps=5000)
    assert (c.window, c.iteration_sample_rate, c.warmup_steps) == (333, 0.1, 500)
    assert type(c.window) is int and type(c.iteration_sample_rate) is float  # (plain values, no marker left)
    short = EDGCConfig(total_steps=300)
    assert (short.window, short.iteration_sample_rate, short.warmup_steps) == (20, 0.25, 30)


def test_what_is_given_is_kept_and_alpha_follows_a_given_window():
    c = EDGCConfig(total_steps=5000, window=10, warmup_steps=7)
    assert (c.window, c.iteration_sample_rate, c.warmup_steps) == (10, 0.5, 7)
    assert EDGCConfig(total_steps=5000, iteration_sample_rate=0.2).iteration_sample_rate == 0.2
    # a round trip and dataclasses.replace keep the values, which are given from then on
    assert EDGCConfig.from_dict(c.to_dict()) == c
    assert dataclasses.replace(c).window == 10


def test_without_it_the_defaults_are_a_long_runs():
    c = EDGCConfig()
    assert (c.window, c.iteration_sample_rate, c.warmup_steps, c.total_steps) == (1000, 0.1, 1000, None)
    assert c.long_run_defaults == RUN_SCALED
    assert EDGCConfig(window=50).long_run_defaults == ("iteration_sample_rate", "warmup_steps")
    assert EDGCConfig(total_steps=100).long_run_defaults == ()


@pytest.mark.parametrize("steps", [0, -5, True, 2.5])
def test_a_bad_length_is_refused_naming_it(steps):
    with pytest.raises(ValueError, match=r"EDGCConfig.total_steps=.*must be a positive integer"):
        EDGCConfig(total_steps=steps)


@pytest.mark.parametrize("steps", [1, 75, 300, 1000, 4000, 100_000])
def test_one_rule_for_the_library_and_edgc_train(steps):
    lib = EDGCConfig(max_rank=32, total_steps=steps)
    run = TrainConfig(steps=steps).resolve().edgc_config()
    assert (lib.window, lib.iteration_sample_rate, lib.warmup_steps) == \
        (run.window, run.iteration_sample_rate, run.warmup_steps) == tuple(run_scaled(steps)[n] for n in RUN_SCALED)


def _run(state: EDGCState, steps: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.Linear(10, 6))
    for step in range(steps):
        x = torch.randn(8, 12, generator=torch.Generator().manual_seed(step))
        model.zero_grad()
        model(x).square().mean().backward()
        sync_with_hook(list(model.parameters()), state, edgc_hook, cap_bytes=200)


def test_the_first_compressed_step_warns_once_when_the_run_length_was_not_given(one_process_group, caplog):
    with caplog.at_level(logging.WARNING, logger="edgc.comm.sync"):
        _run(EDGCState(None, EDGCConfig(max_rank=2, warmup="fixed", warmup_steps=2)), 5)
    said = [r.getMessage() for r in caplog.records if "total_steps" in r.getMessage()]
    assert len(said) == 1 and "once every 1000 steps" in said[0] and "EDGCConfig(total_steps=" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="edgc.comm.sync"):
        _run(EDGCState(None, EDGCConfig(max_rank=2, warmup="fixed", warmup_steps=2, total_steps=50)), 5)
    assert not [r for r in caplog.records if "total_steps" in r.getMessage()]
