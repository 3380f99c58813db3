"""Make tests/data/v1_states.pt: EDGC states saved by edgc 0.1 (state format version 1), and
what edgc 0.1 did after resuming from them, for tests/unit/test_state_upgrade.py.

RUN IT AGAINST THE OLD CODE, not the tree it lives in: commit e4590ca is the last one
whose states are version 1. From the repository root:

    git worktree add --detach /tmp/edgc-v1 e4590ca
    PYTHONPATH=/tmp/edgc-v1/src .venv/bin/python tests/data/make_v1_states.py
    git worktree remove --force /tmp/edgc-v1

(it refuses to run on a tree whose states are not version 1). One process, with a gloo
group of one rank. For each case below it trains the model of
tests/unit/test_checkpoint_states.py (a 2-layer nn.Sequential, plain SGD at 0.1, the
gradient synchronised through edgc_hook by sync_with_hook, buckets of 200 bytes) for 4
steps, saves the state's state_dict() and the weights, then runs 4 more steps and
records the final weights, the stats (less the timing fields) and the rank of each of
the 8 steps (stats().step_rank). It checks that a fresh state loaded from the saved
state_dict, on a fresh model loaded with the saved weights, gives exactly the same 4
steps as the state that went straight on: what is recorded is what 0.1 did on resume.

The file holds {case: {"config": the EDGCConfig keyword arguments, "state": the v1
state_dict at step 4, "weights_at_4", "weights_at_8": the model's state_dict,
"stats_at_8": dataclasses.asdict(stats()) less compress_seconds, comm_seconds and
entropy_seconds, "ranks": step_rank after each of steps 1..8, "lrs": the rate given
to set_learning_rate before each of the 8 steps, or None where it was not called
(the SGD step itself always uses 0.1), "compression_started": the first step, counted
from 1, sent compressed (None: none was)}}, loadable with
torch.load(..., weights_only=False).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import edgc
from edgc import EDGCConfig, EDGCState, edgc_hook
from edgc.comm.buckets import sync_with_hook

OUT = Path(__file__).with_name("v1_states.pt")
STEPS_BEFORE, STEPS_AFTER = 4, 4
TIMING = ("compress_seconds", "comm_seconds", "entropy_seconds")

CASES: dict[str, dict[str, Any]] = {
    # the warm-up the gradient ends (before step 4: checked below)
    "noise-gradient": dict(max_rank=2, min_rank=1, window=2, iteration_sample_rate=1.0, warmup_steps=4,
                           warmup_max_error=0.9),
    "cqm-fixed": dict(policy="cqm", max_rank=2, min_rank=1, window=2, iteration_sample_rate=1.0, warmup_steps=1,
                      warmup_max_error=None),
    "linear-fixed": dict(policy="linear", max_rank=2, min_rank=1, window=2, iteration_sample_rate=1.0,
                         warmup_steps=1, warmup_max_error=None),
    "static-whole-step": dict(policy="static", max_rank=2, window=2, warmup_steps=1, warmup_max_error=None,
                              sync_mode="whole-step"),
    "critical-fixed": dict(policy="critical", max_rank=4, min_rank=1, window=2, iteration_sample_rate=1.0,
                           warmup_steps=1, warmup_max_error=None, critical_threshold=0.3),
    "schedule": dict(policy="schedule", max_rank=4, window=2, warmup_steps=1, warmup_max_error=None,
                     rank_schedule="0:4,4:2"),
    # Two more, for what the cases above leave out on this model. At max_rank 4 no matrix
    # passes min_compression_rate 2 (10x12: 120 / (22 * 4) = 1.4), so "critical-fixed"
    # and "schedule" compress nothing and their weights do not depend on the rank; and
    # with max_rank 2 and rank_multiple 2 the rank cannot move from 2.
    # The 10x12 matrix compressed at ranks 4 and 2, its Q resized after the resume:
    "critical-compressing": dict(policy="critical", max_rank=4, min_rank=1, window=2, iteration_sample_rate=1.0,
                                 warmup_steps=1, warmup_max_error=None, critical_threshold=0.3,
                                 min_compression_rate=1.0),
    # The rank moving (2 to 1) after the resume:
    "linear-moving": dict(policy="linear", max_rank=2, min_rank=1, window=2, iteration_sample_rate=1.0,
                          warmup_steps=1, warmup_max_error=None, rank_multiple=1),
}
#: The learning rate told to the state before each step (set_learning_rate), where one is:
#: 0.1, then 0.01 from step 4 (counted from 0) on, a drop the "critical" policy sees.
LRS: dict[str, list[float]] = {"critical-fixed": [0.1] * 4 + [0.01] * 4, "critical-compressing": [0.1] * 4 + [0.01] * 4}


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.Linear(10, 6))


def _steps(model: torch.nn.Module, state: EDGCState, start: int, n: int, lrs: list[float] | None) -> list[int]:
    """n steps (start, start + 1, ...) of plain SGD with the gradient synchronised through
    edgc_hook; returns the rank each step was sent at (0: uncompressed)."""
    ranks = []
    for step in range(start, start + n):
        if lrs is not None:
            state.set_learning_rate(lrs[step])
        x = torch.randn(8, 12, generator=torch.Generator().manual_seed(step))
        model.zero_grad()
        model(x).square().mean().backward()
        sync_with_hook(list(model.parameters()), state, edgc_hook, cap_bytes=200)
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
        ranks.append(state.stats().step_rank)
    return ranks


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _stats(state: EDGCState) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(state.stats()).items() if k not in TIMING}


def _same(a: Any, b: Any) -> bool:
    """Equal, tensors exactly and nan equal to nan."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def _check_plain(value: Any, where: str = "state") -> None:
    """Raise unless `value` holds only CPU tensors, python numbers, text, None, lists and dicts."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise AssertionError(f"{where}: a tensor on {value.device}")
    elif isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise AssertionError(f"{where}: key {k!r} is not text")
            _check_plain(v, f"{where}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]")
    elif value is not None and type(value) not in (bool, int, float, str):
        raise AssertionError(f"{where}: {type(value).__name__} is not a plain value")


def make_case(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    config, lrs = EDGCConfig(**kwargs), LRS.get(name)
    model, state = _model(), EDGCState(None, config)
    ranks = _steps(model, state, 0, STEPS_BEFORE, lrs)
    saved = copy.deepcopy(state.state_dict())  # (the state goes on: keep the lists it shares as they are now)
    weights_at_4 = _weights(model)
    ranks += _steps(model, state, STEPS_BEFORE, STEPS_AFTER, lrs)

    # 0.1 resumed from what was saved: a fresh state and a fresh model, as a test would
    resumed, r_state = _model(seed=1), EDGCState(None, EDGCConfig(**saved["config"]))
    resumed.load_state_dict(weights_at_4)
    r_state.load_state_dict(copy.deepcopy(saved))
    r_ranks = _steps(resumed, r_state, STEPS_BEFORE, STEPS_AFTER, lrs)
    if not (_same(_weights(resumed), _weights(model)) and _same(_stats(r_state), _stats(state))
            and r_ranks == ranks[STEPS_BEFORE:]):
        raise AssertionError(f"{name}: edgc 0.1 resumed differently from the run that went on")

    _check_plain(saved)
    started = next((i + 1 for i, r in enumerate(ranks) if r), None)
    return {"config": dict(kwargs), "state": saved, "weights_at_4": weights_at_4, "weights_at_8": _weights(model),
            "stats_at_8": _stats(state), "ranks": ranks, "lrs": lrs, "compression_started": started}


def main() -> None:
    import edgc.comm.sync as core

    if getattr(core, "_VERSION", None) != 1:
        sys.exit(f"edgc at {edgc.__file__} does not write version-1 states: run this against commit e4590ca "
                 "(see this script's docstring)")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            cases = {name: make_case(name, kwargs) for name, kwargs in CASES.items()}
        finally:
            dist.destroy_process_group()
    # the gradient-ended warm-up must end before its longest, warmup_steps
    started = cases["noise-gradient"]["compression_started"]
    if started is None or started > CASES["noise-gradient"]["warmup_steps"]:
        raise AssertionError(f"noise-gradient: the gradient did not end the warm-up early (compressed from {started})")
    torch.save(cases, OUT)
    again = torch.load(OUT, weights_only=False)
    assert _same(again, cases)
    print(f"edgc from {edgc.__file__}")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")
    for name, case in cases.items():
        print(f"{name:21s} compressed from step {case['compression_started']}, ranks {case['ranks']}")


if __name__ == "__main__":
    main()
