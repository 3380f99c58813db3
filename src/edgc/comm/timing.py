"""Timing of device work without a host synchronisation per step.

On CUDA, kernels and NCCL collectives run asynchronously: `time.perf_counter()` around
them measures how long it took to *launch* them, and the real cost lands on whichever
later call happens to block (an `.item()`, a `bool(tensor)`). So on CUDA a `Lap` is a pair
of CUDA events recorded on the current stream, and its seconds are read only when
somebody asks for them: a stats snapshot, or a decision that needs a time (r_max
calibration, the DAC's T(r) fit). Reading waits for the lap's end event, and nothing
else; the training loop never stalls for a timer. On the CPU a lap is two
`perf_counter()` readings, since CPU work is done by the time the call returns.

An all-reduce lap on CUDA spans from the point where the current stream reaches the
collective to the point where the current stream is allowed past `work.wait()`, i.e.
the collective's time as the training stream sees it, waiting included.
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["Lap", "LapSum", "start_lap"]


class Lap:
    """One timed interval of work on a device; `float(lap)` gives its seconds."""

    __slots__ = ("_start", "_end", "_seconds")

    def __init__(self, start: Any) -> None:
        self._start = start  # float (CPU) or torch.cuda.Event
        self._end: Any = None
        self._seconds: float | None = None

    def stop(self) -> Lap:
        """End the interval here (on CUDA: at this point of the current stream)."""
        if isinstance(self._start, float):
            self._seconds = time.perf_counter() - self._start
        else:
            self._end = _cuda_event()
        return self

    @property
    def done(self) -> bool:
        """Whether the seconds can be read without waiting."""
        return self._seconds is not None or (self._end is not None and self._end.query())

    def __float__(self) -> float:
        if self._seconds is None:
            if self._end is None:
                raise RuntimeError("Lap.stop() was never called")
            if not self._end.query():
                self._end.synchronize()  # waits for this lap's work only
            self._seconds = self._start.elapsed_time(self._end) / 1000.0  # (ms -> s)
            self._start = self._end = None  # (events are released)
        return self._seconds

    def __repr__(self) -> str:
        return f"Lap({self._seconds if self._seconds is not None else 'pending'})"


def start_lap(device: torch.device | None) -> Lap:
    """Start timing work issued from now on, on `device` (None or CPU: the host clock)."""
    if device is not None and device.type == "cuda":
        return Lap(_cuda_event())
    return Lap(time.perf_counter())


class LapSum:
    """A running total of laps: `add` never waits; `float()` resolves what is pending.

    Finished laps are folded into the total as they complete, so the pending list stays
    short even if nobody reads the total for many steps.
    """

    __slots__ = ("_total", "_pending")

    def __init__(self, total: float = 0.0) -> None:
        self._total = float(total)
        self._pending: list[Lap] = []

    def add(self, lap: Lap | float) -> None:
        if isinstance(lap, Lap) and not lap.done:
            self._pending.append(lap)
            if len(self._pending) > 64:  # fold in the ones that have finished by now
                finished = [p.done for p in self._pending]
                self._total += sum(float(p) for p, f in zip(self._pending, finished, strict=True) if f)
                self._pending = [p for p, f in zip(self._pending, finished, strict=True) if not f]
        else:
            self._total += float(lap)

    def __float__(self) -> float:
        if self._pending:
            self._total += sum(float(p) for p in self._pending)
            self._pending = []
        return self._total


def _cuda_event() -> Any:
    event = torch.cuda.Event(enable_timing=True)
    event.record()  # on the current stream
    return event
