"""The baselines the trainer compares EDGC with, measured the same way as EDGC.

- `AllReduceState` + `allreduce_hook`: DDP's plain all-reduce average, timed.
- `TorchPowerSGDState` + `torch_powersgd_hook`: PyTorch's own powerSGD_hook, made safe for
  gloo by waiting on each bucket's future before the next bucket issues anything. Without
  the wait, replicas can issue the P and Q all-reduces of different buckets in different
  orders and gloo deadlocks or aborts.

Both keep `stats()` returning EDGCStats, so runs of every method log the same fields.
Like edgc_hook they wait for their collectives inside the hook, so no method gets
communication/computation overlap that the others lack.
"""

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as _psgd

from edgc.comm.hook import EDGCStats
from edgc.comm.timing import LapSum, start_lap

__all__ = ["AllReduceState", "TorchPowerSGDState", "allreduce_hook", "torch_powersgd_hook"]


class _Counters:
    """Step and byte/time counters shared by the baseline states."""

    phase = "uncompressed"

    def __init__(self, process_group: dist.ProcessGroup | None) -> None:
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.step = 0
        self.bytes_sent = 0
        self.bytes_uncompressed = 0
        self._comm = LapSum()  # device time in the hook (CUDA events on a GPU, read lazily)

    @property
    def comm_seconds(self) -> float:
        return float(self._comm)

    @comm_seconds.setter
    def comm_seconds(self, value: float) -> None:  # (restored from a checkpoint)
        self._comm = LapSum(value)

    def _rank(self) -> int:
        return 0

    def _step_phase(self) -> str:
        return self.phase

    def _step_rank(self) -> int:
        return self._rank()

    def stats(self) -> EDGCStats:
        return EDGCStats(
            step=self.step, phase=self.phase, rank=self._rank(), step_phase=self._step_phase(),
            step_rank=self._step_rank(), entropy=math.nan, min_rank=0,
            max_rank=self._rank(), bytes_sent=self.bytes_sent, bytes_uncompressed=self.bytes_uncompressed,
            compress_seconds=0.0, comm_seconds=self.comm_seconds, entropy_seconds=0.0,
            nonfinite_steps=0, compressed_steps=0,
        )

    def _counters(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("step", "bytes_sent", "bytes_uncompressed", "comm_seconds")}

    def _load_counters(self, d: dict[str, Any]) -> None:
        for k, v in d.items():
            setattr(self, k, v)


class AllReduceState(_Counters):
    """State of the plain all-reduce hook: only counters."""

    def state_dict(self) -> dict[str, Any]:
        return {"format": "allreduce-state", "world_size": self.world_size, **self._counters()}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        _check(d, "allreduce-state", self.world_size)
        self._load_counters({k: v for k, v in d.items() if k not in ("format", "world_size")})


def allreduce_hook(state: AllReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over replicas (what DDP does without a hook), timing the wait."""
    buffer = bucket.buffer()
    lap = start_lap(buffer.device)
    # collective: all-reduce SUM of the bucket (numel * element_size bytes)
    dist.all_reduce(buffer, group=state.process_group)
    buffer.div_(state.world_size)
    state._comm.add(lap.stop())
    nbytes = buffer.numel() * buffer.element_size()
    state.bytes_sent += nbytes
    state.bytes_uncompressed += nbytes
    if bucket.is_last():
        state.step += 1
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buffer)
    return fut


class TorchPowerSGDState(_Counters):
    """torch's PowerSGDState plus counters; bytes follow torch's own compression rule."""

    def __init__(self, process_group: dist.ProcessGroup | None, rank: int, start_iter: int, min_compression_rate: float = 2.0) -> None:
        super().__init__(process_group)
        self.inner = _psgd.PowerSGDState(
            process_group=process_group, matrix_approximation_rank=rank,
            start_powerSGD_iter=max(2, start_iter), min_compression_rate=min_compression_rate,
            use_error_feedback=True, warm_start=True, batch_tensors_with_same_shape=True,
        )
        self.matrix_rank = rank
        self.last_step_rank = 0  # the rank the last step was sent at (0: uncompressed)

    def _step_rank(self) -> int:
        return self.last_step_rank

    def _step_phase(self) -> str:
        return "compress" if self.last_step_rank else "warmup"

    def _rank(self) -> int:
        return self.matrix_rank if self.inner.iter >= self.inner.start_powerSGD_iter else 0

    @property
    def phase(self) -> str:  # type: ignore[override]
        return "compress" if self._rank() else "warmup"

    def bucket_bytes(self, bucket: dist.GradBucket) -> int:
        """Bytes torch's hook hands to all_reduce for this bucket, by its own rule."""
        if self.inner.iter < self.inner.start_powerSGD_iter:
            return bucket.buffer().numel() * bucket.buffer().element_size()
        total = 0
        r, rate = self.matrix_rank, self.inner.min_compression_rate
        for g in bucket.gradients():
            size = g.element_size()
            if g.dim() > 1:
                m, n = g.shape[0], g.numel() // g.shape[0]
                rr = min(m, n, r)
                if m * n >= rate * (m + n) * rr:
                    total += (m + n) * rr * size
                    continue
            total += g.numel() * size
        return total

    def state_dict(self) -> dict[str, Any]:
        inner = {k: v for k, v in self.inner.__getstate__().items()}
        return {"format": "torch-powersgd-state", "world_size": self.world_size, "inner": inner,
                "last_step_rank": self.last_step_rank, **self._counters()}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        _check(d, "torch-powersgd-state", self.world_size)
        group = self.inner.process_group
        self.inner.__setstate__(d["inner"])
        self.inner.process_group = group
        self._load_counters({k: v for k, v in d.items() if k not in ("format", "world_size", "inner")})


def torch_powersgd_hook(state: TorchPowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's powerSGD_hook, waited on per bucket so gloo sees one collective order."""
    nbytes = state.bucket_bytes(bucket)
    is_last = bucket.is_last()
    rank_now = state._rank()  # (torch's iteration counter moves on at the last bucket)
    lap = start_lap(bucket.buffer().device)
    fut = _psgd.powerSGD_hook(state.inner, bucket)
    fut.wait()
    state._comm.add(lap.stop())  # torch's hook mixes compute and waits
    state.bytes_sent += nbytes
    state.bytes_uncompressed += bucket.buffer().numel() * bucket.buffer().element_size()
    if is_last:
        state.step += 1
        state.last_step_rank = rank_now
    return fut


def _check(d: dict[str, Any], fmt: str, world_size: int) -> None:
    if not isinstance(d, dict) or d.get("format") != fmt:
        raise ValueError(f"checkpoint holds no {fmt} (found {d.get('format') if isinstance(d, dict) else type(d)})")
    if d["world_size"] != world_size:
        raise ValueError(f"{fmt} was saved with world size {d['world_size']}, this job has {world_size}")
