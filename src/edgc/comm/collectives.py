"""Collectives: the groups a synchroniser talks over, every collective it issues, and what
they cost in bytes and time.

Two groups. `process_group` is the group a gradient is averaged over: under DDP every
replica; under HSDP the replicate group of one shard. `control_group` is the group whose
members must reach the same decisions (rank, phase): by default the same one; under HSDP
the whole world, so that every shard runs at the same rank. Control values are agreed
over it; gradients never travel on it.

Why the group is bound at the first step, not in __init__. Frameworks build a hook state
before `init_process_group` (Lightning's PowerSGD recipe does, in the launching process),
and a state may be pickled into the worker processes. A world size read in the
constructor would be 1 there, and every collective would be skipped: replicas would drift
apart while the stats looked normal. So the group, the world size and this replica's rank
are bound when the first buffer arrives (`bind`), and a job of several processes that gets
there without an initialised group is an error.

Every byte counted in `bytes_sent` is a byte handed to a collective; `comm` sums the time
spent waiting for them (on CUDA, read lazily from events: no host synchronisation).
"""

from __future__ import annotations

import collections
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from edgc.comm.timing import LapSum, start_lap
from edgc.comm.wire import WireFormat, WireSum, wire_format

__all__ = ["Collectives", "Issued"]

logger = logging.getLogger(__name__)

#: How many of the latest collectives' handles are kept (Collectives.recent_works). A
#: handle holds the tensors it reduced (gloo keeps them for `result()`), so every handle
#: kept keeps its buffer alive: 256 held up to a few dozen steps' worth of flat buffers and
#: factors (most of edgc's extra resident memory under HSDP, where every module's buffer is
#: a collective of its own). Only the last few can still be referenced by a gloo thread
#: when the process ends.
_RECENT_WORKS = 16


@dataclass
class Issued:
    """An issued collective: its work handle (None: already done); for a CPU tensor
    reduced on the device, (device copy, CPU tensor) to copy back after the wait; for a sum
    in a wire format, the sum, whose later stages run after the wait (WireSum.advance)."""

    work: Any
    back: tuple[torch.Tensor, torch.Tensor] | None = None
    sum: WireSum | None = None


class Collectives:
    """The groups, bound at the first step, and every collective a synchroniser issues."""

    def __init__(self, process_group: dist.ProcessGroup | None = None,
                 control_group: dist.ProcessGroup | None = None) -> None:
        self._process_group = process_group
        self._control_group = control_group
        self.bound: tuple[int, int] | None = None  # (world size, replica rank) from the first step
        self._control_size = 1  # members of the control group (bound with the group)
        self.group_dropped = False  # unpickled from a state whose own group could not travel
        self._expected: tuple[int, int | None, bool] | None = None  # a loaded state's (world, replica, strict)
        self.device: torch.device | None = None  # the gradients' device (set at each step)
        self.bytes_sent = 0
        self.comm = LapSum()  # inside collectives, waiting included
        # The latest collectives' handles, kept so that gloo's threads never drop the last
        # reference to a finished collective: if a thread did, at interpreter shutdown,
        # the process would abort ("terminate called without an active exception") after
        # training finished. Held here, they are freed by Python, with the GIL.
        self.recent_works: collections.deque = collections.deque(maxlen=_RECENT_WORKS)

    # ------------------------------------------------------------------ the groups

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group gradients are averaged over (None: the default group)."""
        return self._process_group

    @process_group.setter
    def process_group(self, group: dist.ProcessGroup | None) -> None:
        if self.bound is not None:
            raise RuntimeError("the EDGC state's process group cannot change after its first step")
        self._process_group = group
        self.group_dropped = False

    @property
    def world_size(self) -> int:
        """Replicas in the group: bound at the first step; before it, what the group says
        now (1 while torch.distributed is not initialised)."""
        return (self.bound or self._identity() or (1, 0))[0]

    @property
    def replica(self) -> int:
        """This process's rank in the group (bound at the first step, like world_size)."""
        return (self.bound or self._identity() or (1, 0))[1]

    @property
    def control_size(self) -> int:
        """Processes that agree the decisions (the control group's size; bound at the first step)."""
        return self._control_size if self.bound is not None else self.world_size

    def _identity(self) -> tuple[int, int] | None:
        """(world size, rank) in the group, or None when torch.distributed is not initialised."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        return dist.get_world_size(self._process_group), dist.get_rank(self._process_group)

    def bind(self) -> None:
        """At the first step: fix the group's world size and this replica's rank, and check
        a loaded state's (`expect`). Raises where a job of several processes would
        otherwise train unsynced."""
        if self.group_dropped:
            raise RuntimeError(
                "this EDGC state was pickled with its own process group, which cannot travel between "
                "processes; set state.process_group = <the DDP's group> before training")
        identity = self._identity()
        if identity is None:
            env_world = int(os.environ.get("WORLD_SIZE", "1") or 1)
            if env_world > 1:
                raise RuntimeError(
                    f"the EDGC hook ran before torch.distributed was initialised, in a job of WORLD_SIZE={env_world}: "
                    "gradients would not be synchronised; call init_process_group first")
            identity = (1, 0)
        if identity[1] < 0:
            raise RuntimeError("this process is not a member of the EDGC state's process group")
        self.bound = identity
        if self._control_group is not None and identity[0] > 1:
            self._control_size = dist.get_world_size(self._control_group)
            if self._control_size % identity[0]:
                raise ValueError(f"the control group ({self._control_size} processes) must be a whole number of "
                                 f"copies of the averaging group ({identity[0]})")
        else:
            self._control_size = identity[0]
        logger.info("EDGC bound to a group of %s replicas, this one rank %s", *identity)
        if self._expected is not None:
            self._check(*self._expected)
            self._expected = None

    def expect(self, world: int, replica: int | None, strict: bool) -> None:
        """A loaded state was saved by `replica` of `world`: check it now where the group is
        known, else at `bind`. Raises ValueError on a mismatch (another replica's state
        only with `strict`; a warning without)."""
        if self.bound is not None or self._identity() is not None:
            self._check(world, replica, strict)
        else:
            self._expected = (world, replica, strict)

    def _check(self, world: int, replica: int | None, strict: bool) -> None:
        if world != self.world_size:
            raise ValueError(
                f"EDGC state was saved with world size {world} but this job has {self.world_size}; "
                "error-feedback buffers are per replica and cannot be remapped")
        if replica is not None and replica != self.replica:
            if strict:
                raise ValueError(
                    f"EDGC state was saved by replica {replica} but is being loaded on replica {self.replica}: "
                    "its error-feedback buffers belong to the replica that built them. Load each replica's own "
                    "state, or pass strict_replica=False to load another replica's on purpose")
            logger.warning("EDGC: loading replica %s's state on replica %s (strict_replica=False)",
                           replica, self.replica)

    # ------------------------------------------------------------------ issuing and waiting

    def all_reduce(self, tensor: torch.Tensor, *, op: Any = dist.ReduceOp.SUM, async_op: bool = False,
                   device_copy: torch.device | None = None, control: bool = False, sum_stage: bool = False) -> Issued:
        """All-reduce `tensor` in place over the process group (`control`: over the control
        group); counts its bytes as sent (`sum_stage`: the all-reduce of a sum in a wire
        format, whose bytes and handle `sum_in` keeps instead).

        A blocking call is timed here; an async call returns a handle for `wait`.
        device_copy: for small control tensors built on the CPU, the device the backend
        needs (NCCL reduces only CUDA tensors); the result is copied back (after the wait).
        """
        if not sum_stage:
            self.bytes_sent += tensor.numel() * tensor.element_size()
        group = self._control_group if control and self._control_group is not None else self._process_group
        if (self.control_size if control else self.world_size) == 1:
            return Issued(None)
        lap = None if async_op else start_lap(self.device)
        back = None
        if device_copy is not None and device_copy.type != "cpu":
            back = (tensor.to(device_copy), tensor)
        work = dist.all_reduce(back[0] if back else tensor, op=op, group=group, async_op=True)
        if not sum_stage:
            self.recent_works.append(work)
        if async_op:
            return Issued(work, back)
        work.wait()
        if back is not None:
            back[1].copy_(back[0].cpu())
        assert lap is not None  # (started above for a blocking call)
        self.comm.add(lap.stop())
        return Issued(None)

    def sum_in(self, flat: torch.Tensor, wire: str | WireFormat) -> Issued:
        """Start summing `flat` over the process group in the wire format `wire`
        (EDGCConfig.wire; edgc.comm.wire.WireFormat.start_sum): quantized, rounded to bf16,
        or as it is. The sum is in `flat` after `wait`. Counts the format's bytes as sent."""
        fmt, world = wire_format(wire), self.world_size
        self.bytes_sent += fmt.sum_bytes(flat, world)
        started = fmt.start_sum(flat, self._process_group, world, self._sum_all_reduce)
        if started.work is None:
            return Issued(None)  # (one replica: nothing in flight)
        self.recent_works.append(started.work)
        return Issued(started.work, sum=started)

    def _sum_all_reduce(self, tensor: torch.Tensor) -> Any:
        """Issue the all-reduce of a plain sum in a wire format (WireFormat.start_sum), as
        every all-reduce is issued (`all_reduce`); its handle (None: one replica)."""
        return self.all_reduce(tensor, async_op=True, sum_stage=True).work

    def wait(self, issued: list[Issued], step_comm: LapSum | None = None) -> None:
        """Wait for async collectives; the time spent waiting counts once as communication
        (in the pipelined mode, that is the part not hidden behind the backward pass; on
        CUDA, how long the current stream stands still for them), and in `step_comm`."""
        pending = [i for i in issued if i.work is not None]
        if not pending:
            return
        lap = start_lap(self.device)
        stage = pending
        while stage:
            for i in stage:
                i.work.wait()
            # the next stage of each sum that has one (a quantized sum's all-gathers), all
            # issued before any is waited for, in the same order on every replica
            stage = [i for i in stage if i.sum is not None and self._advance(i)]
        lap.stop()
        self.comm.add(lap)
        if step_comm is not None:
            step_comm.add(lap)
        for i in pending:
            if i.back is not None:
                i.back[1].copy_(i.back[0].cpu())  # (a host read: control values only)

    def _advance(self, issued: Issued) -> bool:
        """Run what follows a waited stage of a sum: True when it issued another (now `issued.work`)."""
        assert issued.sum is not None
        if not issued.sum.advance():
            return False
        issued.work = issued.sum.work
        self.recent_works.append(issued.work)
        return True

    def agree_mean(self, values: torch.Tensor) -> None:
        """Average a float64 CPU vector in place over the control group (window ends only)."""
        # collective: all-reduce SUM of a few float64 over the control group
        self.all_reduce(values, device_copy=self.device, control=True)
        values /= self.control_size

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        return {"bytes_sent": self.bytes_sent, "comm_seconds": float(self.comm)}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.bytes_sent = int(d["bytes_sent"])
        self.comm = LapSum(float(d["comm_seconds"]))
