"""Run a function on N gloo processes with a hard timeout; shared by the distributed tests."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from edgc.train.launch import WorkerError, run_local


def run_workers(fn: Callable, world: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """fn(rank, world, *args) on `world` processes; a failure or hang fails the test."""
    try:
        return run_local(fn, world, *args, timeout=timeout, threads=1)
    except WorkerError as exc:
        raise AssertionError(f"{exc}\n{exc.details}") from None


def train_args(data: str | Path, out: str | Path, *extra: str) -> list[str]:
    """`edgc train` arguments of a small test run on `data` into `out` (4 sequences of 32
    tokens, rank 4, a short evaluation, no progress bar), then `extra`."""
    return ["train", "--data", str(data), "--out", str(out), "--batch-size", "4", "--block-size", "32",
            "--eval-tokens", "256", "--no-progress", "--rank", "4", *extra]


def run_edgc(*args: str, cwd: str | Path, env: dict[str, str] | None = None,
             timeout: float = 300.0) -> subprocess.CompletedProcess:
    """`python -m edgc ARGS` in `cwd`, as a user runs it; its output captured as text."""
    return subprocess.run([sys.executable, "-m", "edgc", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Nested dicts and lists of tensors and plain values are exactly equal (NaN equals
    NaN); the message names the first path that differs."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: lengths {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b, where
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"
