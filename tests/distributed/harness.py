"""Run a function on N gloo processes with a hard timeout; shared by the distributed tests."""

from __future__ import annotations

from typing import Any, Callable

from edgc.train.launch import WorkerError, run_local


def run_workers(fn: Callable, world: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """fn(rank, world, *args) on `world` processes; a failure or hang fails the test."""
    try:
        return run_local(fn, world, *args, timeout=timeout, threads=1)
    except WorkerError as exc:
        raise AssertionError(f"{exc}\n{exc.details}") from None
