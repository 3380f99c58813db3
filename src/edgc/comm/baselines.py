"""The baselines the trainer compares EDGC with, measured the same way as EDGC.

- `AllReduceState` + `allreduce_hook`: DDP's plain all-reduce average, timed.
- `NoSyncState` + `no_sync_hook`: no communication at all, each replica keeps its own
  gradient. Not a way to train (the replicas drift apart): the compute-only step time
  that a benchmark subtracts from a method's step time to see its exposed communication.
- `TorchPowerSGDState` + `torch_powersgd_hook`: PyTorch's own powerSGD_hook, made safe for
  gloo by waiting on each bucket's future before the next bucket issues anything. Without
  the wait, replicas can issue the P and Q all-reduces of different buckets in different
  orders and gloo deadlocks or aborts. Its buffers follow the parameters when DDP
  re-buckets them, so checkpoints resume exactly (see TorchPowerSGDState).

They keep `stats()` returning EDGCStats, so runs of every method log the same fields.
They wait for their collectives inside the hook, as edgc_hook's whole-step mode does;
edgc_hook's pipelined mode overlaps its own with the backward pass (and DDP's built-in
all-reduce, used when no hook is registered, overlaps too).
"""

import math
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as _psgd

from edgc.comm.hook import EDGCStats
from edgc.comm.timing import LapSum, start_lap

__all__ = ["AllReduceState", "NativeHSDPState", "NoSyncState", "TorchPowerSGDState", "allreduce_hook", "no_sync_hook",
           "torch_powersgd_hook"]

# TorchPowerSGDState: 3 saves torch's numpy RandomState as plain values (a weights-only load
# takes them), 2 saves torch's buffers per parameter (1: per DDP bucket, as torch keeps them)
STATE_VERSION = 3


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


class _CountersOnly(_Counters):
    """A hook state that is only counters; its checkpoint format is named by `FORMAT`."""

    FORMAT = ""

    def state_dict(self) -> dict[str, Any]:
        return {"format": self.FORMAT, "world_size": self.world_size, **self._counters()}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        _check(d, self.FORMAT, self.world_size)
        self._load_counters({k: v for k, v in d.items() if k not in ("format", "world_size")})


class AllReduceState(_CountersOnly):
    """State of the plain all-reduce hook: only counters."""

    FORMAT = "allreduce-state"


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


class NativeHSDPState(_CountersOnly):
    """Counters of native HSDP (fully_shard on the 2-D mesh), which all-reduces each
    module's reduce-scatter output across the replicate group itself: `count` sees each
    such output once FSDP has reduced it (edgc.fsdp.count_native_hsdp sets it as the
    modules' all-reduce hook), and counts the bytes FSDP handed to that all-reduce."""

    FORMAT = "native-hsdp-state"

    def __init__(self, process_group: dist.ProcessGroup | None, modules: int) -> None:
        super().__init__(process_group)
        self.modules = modules  # the hooked modules: one call each per step
        self._calls = 0
        self.expert_state: NativeHSDPState | None = None  # the experts' counters (edgc.fsdp.count_native_hsdp)

    def expert_stats(self) -> Any:
        """The experts' counters (their own all-reduce), or None without experts."""
        return self.expert_state.stats() if self.expert_state is not None else None

    def count(self, output: torch.Tensor) -> None:
        nbytes = output.numel() * output.element_size()
        self.bytes_sent += nbytes
        self.bytes_uncompressed += nbytes
        self._calls += 1
        if self._calls == self.modules:
            self._calls = 0
            self.step += 1


class NoSyncState(_CountersOnly):
    """State of the no-sync hook (compute-only runs): only counters, nothing sent."""

    FORMAT = "no-sync-state"


def no_sync_hook(state: NoSyncState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Leave the bucket as it is: this replica's own gradient, no collective."""
    state.bytes_uncompressed += bucket.buffer().numel() * bucket.buffer().element_size()
    if bucket.is_last():
        state.step += 1
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class TorchPowerSGDState(_Counters):
    """torch's PowerSGDState plus counters; bytes follow torch's own compression rule.

    torch keys its error feedback (`error_dict`) and warm-start P/Q memories by DDP bucket
    index, each a flat buffer in that bucket's parameter order. DDP rebuilds its buckets
    after the first iteration of every job, so a checkpoint holds them in the rebuilt
    layout while a resumed job's first step runs in the initial one: saved as-is, the error
    feedback and Q would land on the wrong parameters. So this wrapper, told the module
    (`module=` or `bind`), records each bucket's layout (its parameters' indices in
    `module.parameters()`) at every hook call, saves the buffers per parameter, and
    whenever a bucket's layout differs from the one its buffers were written in (after a
    load, or at DDP's rebuild after a resume), splits them per parameter and re-assembles
    them for the layout the bucket has now, before torch's hook reads them. The copies
    are exact, so a resumed run repeats the uninterrupted one bit for bit.
    """

    _BUFFERS = ("error_dict", "p_memory_dict", "q_memory_dict")

    def __init__(self, process_group: dist.ProcessGroup | None, rank: int, start_iter: int,
                 min_compression_rate: float = 2.0, module: torch.nn.Module | None = None) -> None:
        super().__init__(process_group)
        self.inner = _psgd.PowerSGDState(
            process_group=process_group, matrix_approximation_rank=rank,
            start_powerSGD_iter=max(2, start_iter), min_compression_rate=min_compression_rate,
            use_error_feedback=True, warm_start=True, batch_tensors_with_same_shape=True,
        )
        self.matrix_rank = rank
        self.last_step_rank = 0  # the rank the last step was sent at (0: uncompressed)
        self.module: torch.nn.Module | None = None
        self._params: list[torch.nn.Parameter] = []
        self._index: dict[int, int] = {}  # id(parameter) -> its index in module.parameters()
        self._layouts: dict[int, tuple[int, ...]] = {}  # bucket -> layout its torch buffers are in
        self._pending: _PerParam | None = None  # per-parameter state not yet in torch's buffers
        if module is not None:
            self.bind(module)

    def bind(self, module: torch.nn.Module) -> None:
        """The module DDP wraps: its parameter order names parameters in checkpoints."""
        self.module = module
        self._params, self._index = [], {}

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

    # -- bucket layouts ------------------------------------------------------------------

    def _read_params(self) -> None:
        assert self.module is not None
        self._params = list(self.module.parameters())
        self._index = {id(q): j for j, q in enumerate(self._params)}

    def _param_index(self, p: torch.Tensor) -> int:
        i = self._index.get(id(p))
        if i is None or self._params[i] is not p:
            self._read_params()
            i = self._index.get(id(p))
            if i is None:
                raise RuntimeError("a DDP bucket holds a parameter that is not in the module "
                                   "TorchPowerSGDState was bound to (bind the module DDP wraps)")
        return i

    def _shapes(self, layout: tuple[int, ...]) -> list[torch.Size]:
        if not self._params:
            self._read_params()
        return [self._params[i].shape for i in layout]

    def _matrices(self, layout: tuple[int, ...]) -> list[tuple[int, int, int, int, int, int]]:
        """(position in bucket, P offset, Q offset, n, m, r) of each matrix torch compresses
        in a bucket of this layout, in torch's order (grouped by shape)."""
        return _matrix_layout(self._shapes(layout), self.inner.matrix_approximation_rank,
                              self.inner.min_compression_rate)

    def _has_buffers(self) -> bool:
        return any(getattr(self.inner, name) for name in self._BUFFERS)

    def _split(self) -> "_PerParam":
        """torch's per-bucket buffers, per parameter (copies); torch's are left alone."""
        out = _PerParam()
        inner = self.inner
        for b, flat in inner.error_dict.items():
            layout = self._layout_of(b)
            offset = 0
            for i, shape in zip(layout, self._shapes(layout), strict=True):
                n = shape.numel()
                out.error[i] = flat[offset:offset + n].detach().clone().view(shape)
                offset += n
            if offset != flat.numel():
                raise RuntimeError(f"error feedback of bucket {b} holds {flat.numel()} values, its layout {offset}")
        for b, pmem in inner.p_memory_dict.items():
            layout = self._layout_of(b)
            qmem = inner.q_memory_dict[b]
            out.memory.update(layout)
            ptotal = qtotal = 0
            for k, po, qo, n, m, r in self._matrices(layout):
                i = layout[k]
                out.p[i] = pmem[po:po + n * r].detach().clone().view(n, r)
                out.q[i] = qmem[qo:qo + m * r].detach().clone().view(m, r)
                ptotal, qtotal = po + n * r, qo + m * r
            if (ptotal, qtotal) != (pmem.numel(), qmem.numel()):
                raise RuntimeError(f"P/Q memory of bucket {b} holds {pmem.numel()}/{qmem.numel()} values, "
                                   f"its layout {ptotal}/{qtotal}")
        return out

    def _layout_of(self, b: int) -> tuple[int, ...]:
        if b not in self._layouts:
            raise RuntimeError(f"torch's PowerSGD state holds bucket {b}, whose layout was never seen "
                               "(was the state bound to the module before DDP's first step?)")
        return self._layouts[b]

    def _assemble(self, b: int, layout: tuple[int, ...], like: torch.Tensor) -> None:
        """Build torch's buffers of bucket `b` (now in `layout`) from the pending per-parameter state."""
        pending = self._pending
        assert pending is not None
        kw: dict[str, Any] = {"device": like.device, "dtype": like.dtype}
        has = [i in pending.error for i in layout]
        if all(has):
            self.inner.error_dict[b] = torch.cat([pending.error.pop(i).reshape(-1) for i in layout]).to(**kw)
        elif any(has):
            raise RuntimeError(f"the saved error feedback covers only part of DDP bucket {b}")
        has = [i in pending.memory for i in layout]
        if all(has):
            mats = self._matrices(layout)
            ptotal = sum(n * r for _, _, _, n, _, r in mats)
            qtotal = sum(m * r for _, _, _, _, m, r in mats)
            pmem, qmem = torch.empty(ptotal, **kw), torch.empty(qtotal, **kw)
            for k, po, qo, n, m, r in mats:
                i = layout[k]
                if i not in pending.q or i not in pending.p:
                    raise RuntimeError(f"the saved warm-start P/Q lacks parameter {i} of DDP bucket {b}")
                pmem[po:po + n * r] = pending.p.pop(i).reshape(-1)
                qmem[qo:qo + m * r] = pending.q.pop(i).reshape(-1)
            self.inner.p_memory_dict[b], self.inner.q_memory_dict[b] = pmem, qmem
            pending.memory.difference_update(layout)
        elif any(has):
            raise RuntimeError(f"the saved warm-start P/Q covers only part of DDP bucket {b}")
        if pending.empty():
            self._pending = None

    def _moved(self, b: int, layout: tuple[int, ...]) -> bool:
        """Whether torch's buffers hold bucket `b` in another layout, or hold any of its
        parameters in another bucket."""
        held = set().union(*(getattr(self.inner, name).keys() for name in self._BUFFERS))
        if b in held and self._layouts.get(b) != layout:
            return True
        mine = set(layout)
        return any(not mine.isdisjoint(self._layout_of(k)) for k in held if k != b)

    def before_bucket(self, bucket: dist.GradBucket) -> None:
        """Bring torch's buffers for `bucket` into the layout it has now (the hook calls this)."""
        if self.module is None:
            return
        b = bucket.index()
        layout = tuple(self._param_index(p) for p in bucket.parameters())
        if sum(s.numel() for s in self._shapes(layout)) != bucket.buffer().numel():
            raise RuntimeError(f"DDP bucket {b} is not its parameters laid end to end")
        if self._moved(b, layout):
            # DDP moved parameters: every bucket's buffers go per parameter, to be rebuilt
            # bucket by bucket in the new layout (those already seen this step stay exact)
            split = self._split()
            if self._pending is not None:
                split.update(self._pending)
            self._pending = split
            for name in self._BUFFERS:
                getattr(self.inner, name).clear()
        if self._pending is not None:
            self._assemble(b, layout, bucket.buffer())
        self._layouts[b] = layout

    # -- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        inner = {slot: getattr(self.inner, slot) for slot in self.inner.__slots__
                 if slot != "process_group" and slot not in self._BUFFERS}
        inner["rng"] = _rng_values(inner["rng"])
        if self._has_buffers() and self.module is None:
            raise RuntimeError("TorchPowerSGDState needs the module (module= or bind) to save its compression state")
        params = self._split()
        if self._pending is not None:
            params.update(self._pending)
        return {"format": "torch-powersgd-state", "version": STATE_VERSION, "world_size": self.world_size,
                "inner": inner, "params": params.to_dict(), "last_step_rank": self.last_step_rank,
                **self._counters()}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        _check(d, "torch-powersgd-state", self.world_size)
        version = d.get("version", 1)
        inner = dict(d["inner"])
        if version == 1:  # per-bucket buffers in a DDP layout the checkpoint does not name
            if any(inner.get(name) for name in self._BUFFERS):
                raise ValueError("this torch-powersgd checkpoint was written by an older edgc that saved torch's "
                                 "error feedback and warm-start Q per DDP bucket, in a layout a resumed job "
                                 "does not have at its first step; it cannot be resumed exactly. Start the run "
                                 "again (or resume from a checkpoint taken before compression started)")
            params = _PerParam()
        elif version in (2, STATE_VERSION):
            params = _PerParam.from_dict(d["params"])
        else:
            raise ValueError(f"torch-powersgd-state has version {version}, this edgc reads {STATE_VERSION}")
        if not params.empty():
            if self.module is None:
                raise RuntimeError("TorchPowerSGDState needs the module (module= or bind) to load compression state")
            self._check_params(params, inner.get("matrix_approximation_rank", self.inner.matrix_approximation_rank))
        if isinstance(inner.get("rng"), dict):  # (version 3; before, numpy's object itself)
            inner["rng"] = _rng_from_values(inner["rng"])
        for slot, value in inner.items():
            if slot != "process_group" and slot not in self._BUFFERS:
                setattr(self.inner, slot, value)
        for name in self._BUFFERS:
            setattr(self.inner, name, {})
        self._layouts = {}
        self._pending = None if params.empty() else params
        not_counters = ("format", "version", "world_size", "inner", "params")
        self._load_counters({k: v for k, v in d.items() if k not in not_counters})

    def _check_params(self, params: "_PerParam", r: int) -> None:
        assert self.module is not None
        shapes = [p.shape for p in self.module.parameters()]
        outside = sorted(i for i in params.memory if not 0 <= i < len(shapes))
        if outside:
            raise ValueError(f"torch-powersgd-state names parameter {outside[0]}; the module has {len(shapes)}")
        for kind, tensors in (("error feedback", params.error), ("P", params.p), ("Q", params.q)):
            for i, t in tensors.items():
                if not 0 <= i < len(shapes):
                    raise ValueError(f"torch-powersgd-state holds {kind} of parameter {i}; "
                                     f"the module has {len(shapes)}")
                n, m = shapes[i][0], shapes[i].numel() // shapes[i][0]
                want = {"error feedback": shapes[i], "P": (n, min(n, m, r)), "Q": (m, min(n, m, r))}[kind]
                if tuple(t.shape) != tuple(want):
                    raise ValueError(f"torch-powersgd-state holds {kind} of shape {tuple(t.shape)} for parameter {i}, "
                                     f"which needs {tuple(want)}")


def _rng_values(rng: np.random.RandomState) -> dict[str, Any]:
    """The state of torch's numpy generator (it seeds each new Q) as plain values: the
    Mersenne Twister's keys as an int64 tensor, the rest as numbers. Changes nothing."""
    state = rng.get_state(legacy=False)
    keys = torch.from_numpy(state["state"]["key"].astype(np.int64))
    return {"bit_generator": str(state["bit_generator"]), "keys": keys, "pos": int(state["state"]["pos"]),
            "has_gauss": int(state["has_gauss"]), "gauss": float(state["gauss"])}


def _rng_from_values(d: dict[str, Any]) -> np.random.RandomState:
    """A numpy generator in the state `_rng_values` returned."""
    rng = np.random.RandomState()
    rng.set_state({"bit_generator": d["bit_generator"], "has_gauss": int(d["has_gauss"]), "gauss": float(d["gauss"]),
                   "state": {"key": d["keys"].numpy().astype(np.uint32), "pos": int(d["pos"])}})
    return rng


class _PerParam:
    """torch's PowerSGD buffers cut per parameter (keys: index in module.parameters()):
    error feedback in the parameter's shape, warm-start P (n, r) and Q (m, r) of each
    compressed matrix, and `memory`, the parameters whose bucket had P/Q memory (a bucket
    with none to compress still has an empty one, which tells torch not to draw new Qs)."""

    def __init__(self) -> None:
        self.error: dict[int, torch.Tensor] = {}
        self.p: dict[int, torch.Tensor] = {}
        self.q: dict[int, torch.Tensor] = {}
        self.memory: set[int] = set()

    def empty(self) -> bool:
        return not (self.error or self.p or self.q or self.memory)

    def update(self, other: "_PerParam") -> None:
        self.error.update(other.error)
        self.p.update(other.p)
        self.q.update(other.q)
        self.memory |= other.memory

    def to_dict(self) -> dict[str, Any]:
        return {"error": dict(self.error), "p": dict(self.p), "q": dict(self.q), "memory": sorted(self.memory)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "_PerParam":
        out = cls()
        out.error, out.p, out.q = dict(d["error"]), dict(d["p"]), dict(d["q"])
        out.memory = set(d["memory"])
        return out


def _matrix_layout(shapes: list[torch.Size], rank: int, min_compression_rate: float
                   ) -> list[tuple[int, int, int, int, int, int]]:
    """Where torch's powerSGD_hook keeps the P and Q of each matrix of a bucket whose
    gradients have these shapes: (position, P offset, Q offset, n, m, r), following its
    code: each gradient viewed as (shape[0], -1), compressed by `_should_compress`, grouped
    by matrix shape in order of first appearance, bucket order within a group."""
    groups: dict[tuple[int, int], list[int]] = {}
    for k, shape in enumerate(shapes):
        n = shape[0]
        m = shape.numel() // n
        if _psgd._should_compress(n, m, min(n, m, rank), min_compression_rate)[0]:
            groups.setdefault((n, m), []).append(k)
    out = []
    po = qo = 0
    for (n, m), ks in groups.items():
        r = min(n, m, rank)
        for k in ks:
            out.append((k, po, qo, n, m, r))
            po += n * r
            qo += m * r
    return out


def torch_powersgd_hook(state: TorchPowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's powerSGD_hook, waited on per bucket so gloo sees one collective order."""
    state.before_bucket(bucket)  # (torch's buffers into this bucket's current layout)
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
