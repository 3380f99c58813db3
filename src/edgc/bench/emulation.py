"""The emulated cluster's two other knobs: one core per worker, and links set by sync share.

On a machine with fewer cores than its workers need, the workers' arithmetic, gloo's
threads and the kernel's packet work all queue for the same cores, so a method that sends
fewer bytes barely gains time: the step is compute-bound. `edgc bench train` can instead

- pin each worker to cores of its own (`worker_cores`: `taskset` on the worker's argv),
  so one worker's sync never waits for another worker's arithmetic; and
- set every link's rate so that the uncompressed sync takes a chosen share of the step
  (`SyncShare`): a short compute-only run on loopback, with the same pinning and the same
  `edgc train` options, measures one step's compute time C and its gradient bytes G; an
  uncompressed ring all-reduce sends 2(W-1)/W * G per worker, each way, so the rate that
  makes it take S = share / (1 - share) * C is R = 2(W-1)/W * G * 8 / S bits per second,
  and sync / (compute + sync) = share, as `edgc simulate` counts it (no overlap).

With `edgc train --emulated-device-ms` the compute is mostly idle waiting, as a host
waits for its GPU, so the sync runs while the "device" works (docs/emulation.md says how
this maps to a real cluster, and where it does not).
"""

from __future__ import annotations

import os
import shutil
import statistics
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from edgc.bench.cluster import run_on_cluster
from edgc.bench.comm import ring_allreduce_seconds
from edgc.bench.netns import Cluster
from edgc.train.summary import load_run

__all__ = ["SyncShare", "calibrate", "link_rate", "measured_compute", "worker_cores"]

#: Above this per-link rate, veth links between namespaces on one machine fall short of
#: the tbf rate (the kernel's packet work then limits them): the report warns.
FAST_LINK_BITS = 5e9


def worker_cores(workers: int, per_worker: int, available: Collection[int] | None = None) -> list[list[int]]:
    """The CPUs each worker is pinned to: consecutive runs of `per_worker` of the cores
    this process may use (`available`, by default its affinity). Raises ValueError when
    there are fewer than `workers` * `per_worker` of them, or taskset is missing."""
    if per_worker < 1:
        raise ValueError(f"--cores-per-worker {per_worker} must be at least 1")
    cores = sorted(os.sched_getaffinity(0) if available is None else available)
    need = workers * per_worker
    if len(cores) < need:
        raise ValueError(f"--cores-per-worker {per_worker} for {workers} workers needs {need} cores, but this "
                         f"process may use {len(cores)} ({','.join(map(str, cores))}): run fewer workers or "
                         "fewer cores per worker, or leave --cores-per-worker out to share the cores")
    if shutil.which("taskset") is None:
        raise ValueError("--cores-per-worker needs taskset (Debian package util-linux); install it, or leave "
                         "--cores-per-worker out")
    return [cores[i * per_worker:(i + 1) * per_worker] for i in range(workers)]


def link_rate(grad_bytes: float, workers: int, sync_s: float) -> float:
    """Bits per second per link, each way, at which an uncompressed ring all-reduce of
    `grad_bytes` over `workers` takes `sync_s`: 2(W-1)/W * grad_bytes * 8 / sync_s."""
    if workers < 2 or grad_bytes <= 0 or sync_s <= 0:
        raise ValueError(f"a link rate needs 2 or more workers, gradient bytes and a sync time > 0 "
                         f"(got {workers} workers, {grad_bytes} bytes, {sync_s} s)")
    return ring_allreduce_seconds(grad_bytes, workers, 1.0) / sync_s  # (its time at 1 bit/s, over the time asked)


def measured_compute(records: list[dict]) -> tuple[float, float, int]:
    """(seconds, gradient bytes, steps timed) of one step of a compute-only run's records:
    the median step time and median uncompressed bytes of its train records, leaving out
    the first quarter (start-up: allocation, the first DDP iteration's bucket rebuild)."""
    train = [r for r in records if r.get("kind") == "train"]
    if not train:
        raise ValueError("the calibration run logged no training steps")
    timed = train[len(train) // 4:]
    return (statistics.median(r["step_time"] for r in timed),
            statistics.median(r["bytes_uncompressed"] for r in timed), len(timed))


@dataclass
class SyncShare:
    """The link rate `--sync-share` chose, and the measurements it came from."""

    share: float  # of the uncompressed step spent in the sync: sync / (compute + sync)
    workers: int
    compute_s: float  # one step without any sync (measured_compute)
    grad_bytes: float  # one step's gradient, uncompressed, per worker
    steps: int  # steps the compute time is the median of

    def __post_init__(self) -> None:
        if not 0 < self.share < 1:
            raise ValueError(f"--sync-share {self.share} must be between 0 and 1 (e.g. 0.43 for 43% of the step)")

    @property
    def sync_s(self) -> float:
        """The uncompressed sync time that makes it `share` of the step."""
        return self.share / (1 - self.share) * self.compute_s

    @property
    def bits_per_second(self) -> float:
        return link_rate(self.grad_bytes, self.workers, self.sync_s)

    @property
    def bandwidth(self) -> str:
        """The rate in tc's syntax, as --bandwidth takes it."""
        return f"{self.bits_per_second / 1e3:.0f}kbit"

    def explain(self) -> str:
        """One paragraph: the rate, and the numbers and formula that gave it."""
        ring = 2 * (self.workers - 1) / self.workers
        text = (f"Links set for a {self.share:.0%} sync share: a compute-only run on loopback (same workers, "
                f"pinning and options) took {self.compute_s * 1e3:.1f} ms per step (median of {self.steps} steps) "
                f"with {self.grad_bytes / 1e6:.2f} MB of gradient per worker. An uncompressed ring all-reduce sends "
                f"2(W-1)/W = {ring:.2f} x that per worker each way; to take {self.share:.2f}/(1-{self.share:.2f}) "
                f"x {self.compute_s * 1e3:.1f} = {self.sync_s * 1e3:.1f} ms it needs "
                f"{self.bits_per_second / 1e6:.1f} Mbit/s per link each way (`--bandwidth {self.bandwidth}`).")
        if self.bits_per_second > FAST_LINK_BITS:
            text += (f" Links between namespaces on one machine may not reach {FAST_LINK_BITS / 1e9:.0f} Gbit/s: "
                     "raise --emulated-device-ms, so the step and with it the sync take longer.")
        return text


def calibrate(workers: int, cores: list[list[int]] | None, train_args: list[str], run_dir: Path, steps: int, *,
              timeout: float) -> tuple[float, float, int]:
    """Run `edgc train TRAIN_ARGS` as a compute-only run of `steps` steps in `run_dir`, on
    loopback with the workers pinned to `cores`, and return `measured_compute` of it.
    TRAIN_ARGS are every run's arguments; later ones win, so evaluation and checkpoints are
    cut to one small pass each at the end (they are not in the step time anyway)."""
    args = [*train_args, "--method", "compute-only", "--steps", str(steps), "--out", str(run_dir),
            "--eval-every", str(steps), "--eval-tokens", "1", "--checkpoint-every", str(steps)]
    with Cluster(workers, None, cores=cores) as loopback:
        run_on_cluster(loopback, args, timeout=timeout)
    _, records = load_run(run_dir)
    return measured_compute(records)
