"""Run a function on N gloo processes with a hard timeout; shared by the distributed tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from edgc.train.launch import WorkerError, run_local


def run_workers(fn: Callable, world: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """fn(rank, world, *args) on `world` processes; a failure or hang fails the test."""
    try:
        return run_local(fn, world, *args, timeout=timeout, threads=1)
    except WorkerError as exc:
        raise AssertionError(f"{exc}\n{exc.details}") from None


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
