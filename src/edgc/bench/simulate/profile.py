"""The cost profile `edgc simulate` projects with, and timing EDGC's arithmetic on a device.

- `CostProfile`: the seconds of a low-rank round per (m, n, rank) and of the GDS estimate,
  filled in by one `CostSource` (the roofline model of a GPU, or a `DeviceTimer`), saved to
  and loaded from JSON with where every number came from ("roofline:<GPU>" or
  "measured:<device name>").
- `DeviceTimer`: times the same operations the roofline model costs, on the local CPU or
  GPU. On CUDA kernel launches are asynchronous, so a wall clock around them measures the
  launches, not the work: the timer records CUDA events on the device's stream around the
  work and reads their elapsed time after the end event has completed.
"""

from __future__ import annotations

import functools
import json
import logging
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from edgc.bench.simulate.costs import DDP_BUCKET_BYTES, CostSource, EntropyCost
from edgc.bench.simulate.gpu import working_bytes
from edgc.compress import orthogonalize_, project_p, project_q
from edgc.config import EDGCConfig
from edgc.entropy import estimate_entropy, sample_gradient

logger = logging.getLogger(__name__)

__all__ = ["CostProfile", "DeviceTimer", "device_name"]

_PROFILE_FORMAT = "edgc-cost-profile"
_PROFILE_VERSION = 2  # 2: origins with details, per-entry batch, affine entropy cost

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def device_name(device: torch.device) -> str:
    """Return a readable name of `device`: the CUDA device name, or "cpu (<arch>, N threads)"."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


class DeviceTimer:
    """A `CostSource` that times EDGC's arithmetic on a local device.

    - low-rank round: the round of edgc.comm.step on one unit's batch of same-shape
      matrices, ceil(count / units), at most max_batch (M gathered from the buckets with the
      error added, P = MQ, orthogonalise, Q = MᵀP, P and Q to the wire dtype and back, keep
      Q and the dead-Q check, M gathered again, E = M - P Qᵀ in one baddbmm, the average
      and its copy back into the buckets), median of `repeats` runs after one untimed
      warm-up, scaled to the full count by count / measured batch;
    - GDS: the non-finite check, the strided sample and the estimate over a gradient held
      in DDP-sized buckets, timed at `entropy_elements` and a quarter of it; the two points
      give the fixed and per-element cost.

    CUDA timing uses torch.cuda.Event(enable_timing=True) recorded on the device's current
    stream around the work, read after the end event synchronises.
    """

    exhaustive = False
    measures = True

    def __init__(
        self,
        device: str | torch.device = "cpu",
        *,
        dtype: str = "float32",
        repeats: int = 3,
        max_batch: int | None = None,
        entropy_elements: int = 1 << 24,
        units: int = EDGCConfig.max_units,
        orthogonalization: str = EDGCConfig.orthogonalization,
    ) -> None:
        # hyperparameters
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"--device {device!r}: must be cpu or cuda")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: CUDA is not available on this machine")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        self.dtype_name = dtype
        self.dtype = _DTYPES[dtype]  # the gradients' dtype
        self.units = units  # EDGCConfig.max_units: a shape's matrices are timed as one unit's batch
        self.orthogonalization = orthogonalization  # EDGCConfig.orthogonalization
        # the hook's working dtype (edgc.comm.step.working_dtype): float32 for half gradients
        self.work_dtype = torch.float32 if working_bytes(self.dtype.itemsize) == 4 else self.dtype
        self.repeats = repeats
        # the whole batch on a GPU (as the hook runs it); at most 2 on a CPU, to keep it short
        self.max_batch = max_batch if max_batch is not None else (None if self.device.type == "cuda" else 2)
        self.entropy_elements = entropy_elements
        self.name = device_name(self.device)
        logger.info("timing on %s in %s, %s repeats", self.name, dtype, repeats)

    @property
    def origin(self) -> str:
        return f"measured:{self.name}"

    @property
    def detail(self) -> str:
        clock = "CUDA events" if self.device.type == "cuda" else "perf_counter"
        work = str(self.work_dtype).removeprefix("torch.")
        return (f"{self.dtype_name} gradients compressed in {work}, torch {torch.__version__}, "
                f"median of {self.repeats} timed with {clock}")

    # --- timing

    def time(self, fn: Callable[[], Any]) -> float:
        """Return the median seconds of fn() over `repeats` runs after one untimed warm-up.

        CUDA: the warm-up is followed by a device synchronize; each run is bracketed by two
        CUDA events on the device's current stream and its time read with
        `start.elapsed_time(end)` after `end.synchronize()`. CPU: perf_counter around fn().
        """
        fn()
        times = []
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            stream = torch.cuda.current_stream(self.device)
            for _ in range(self.repeats):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record(stream)
                fn()
                end.record(stream)
                end.synchronize()  # the work is done before the clock is read
                times.append(start.elapsed_time(end) / 1e3)  # elapsed_time is in milliseconds
        else:
            for _ in range(self.repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def _randn(self, shape: tuple[int, ...], gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * scale).to(self.device, self.dtype)

    def lowrank(self, m: int, n: int, ranks: Sequence[int], batch: int) -> dict[int, float]:
        """Return {rank: seconds of one round over `batch` (m, n) matrices}, timed on a
        batch of min(batch, max_batch) and scaled by batch / measured batch.

        The round is edgc.comm.hook's compress phase without its collectives, in the same
        dtypes: gradients in `dtype`, arithmetic in the working dtype (float32 for half
        gradients), P and Q copied to the gradient dtype and back around their all-reduces.
        """
        gen = torch.Generator().manual_seed(0)
        unit = -(-batch // max(1, min(self.units or 1, batch)))  # the matrices of one unit's batch
        b = max(1, unit if self.max_batch is None else min(unit, self.max_batch))
        work = self.work_dtype
        cast = work != self.dtype
        grads = [self._randn((m, n), gen) for _ in range(b)]  # b gradients of (m, n)
        error = self._randn((b, m, n), gen, 1e-3).to(self.dtype)  # (B, m, n), kept in the gradients' dtype
        mat = torch.empty((b, m, n), device=self.device, dtype=work)  # the workspace

        def one_round(q0: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
                      p_wire: torch.Tensor, q_wire: torch.Tensor, kept: torch.Tensor) -> None:
            # M gathered from the buckets into the workspace and the error added, each of the
            # three times a unit that spans several buckets reads it
            torch._foreach_copy_(list(mat.unbind(0)), grads)
            mat.add_(error)
            project_p(mat, q0, out=p)  # (B, m, r)
            if cast:
                p_wire.copy_(p)  # (P's all-reduce goes here)
                p.copy_(p_wire)
            orthogonalize_(p, self.orthogonalization)
            torch._foreach_copy_(list(mat.unbind(0)), grads)  # M read again for Q
            mat.add_(error)
            project_q(mat, p, out=q)  # (B, n, r)
            if cast:
                q_wire.copy_(q)  # (Q's all-reduce goes here)
                q.copy_(q_wire)
            q.div_(2)  # the average over replicas
            kept.copy_(q)
            bool((torch.linalg.vector_norm(kept, float("inf"), dim=(1, 2)) == 0).any())  # the dead-Q check
            torch._foreach_copy_(list(mat.unbind(0)), grads)  # M read again for the end
            mat.add_(error)
            if error.dtype == work:  # E = M - P Q^T, straight into E
                torch.baddbmm(mat, p, q.mT, alpha=-1, out=error)
            else:  # (E kept in the half dtype: through M, then rounded into E)
                mat.baddbmm_(p, q.mT, alpha=-1)
                error.copy_(mat)
            torch.bmm(p, q.mT, out=mat)  # the average, then into the buckets
            torch._foreach_copy_(grads, list(mat.unbind(0)))

        out = {}
        for r in ranks:
            r = min(r, m, n)
            q0 = self._randn((b, n, r), gen).to(work)  # (B, n, r)
            p = torch.empty((b, m, r), device=self.device, dtype=work)
            q = torch.empty((b, n, r), device=self.device, dtype=work)
            p_wire = torch.empty_like(p, dtype=self.dtype)  # (B, m, r) as it travels
            q_wire = torch.empty_like(q, dtype=self.dtype)  # (B, n, r)
            kept = torch.empty_like(q)
            out[r] = self.time(functools.partial(one_round, q0, p, q, p_wire, q_wire, kept)) * batch / b
            logger.info("timed (%s, %s) x%s at rank %s: %.3g s", m, n, b, r, out[r] / batch * b)
        return out

    def entropy(self, rate: float, estimator: str, bins: int) -> EntropyCost:
        """Return the GDS cost from timings at `entropy_elements` and a quarter of it."""
        gen = torch.Generator().manual_seed(1)
        bucket = max(1, DDP_BUCKET_BYTES // torch.empty(0, dtype=self.dtype).element_size())

        def seconds(numel: int) -> float:
            grad = self._randn((numel,), gen, 1e-3)
            buckets = list(grad.split(bucket))

            def one_estimate() -> None:
                bool(all(bool(torch.isfinite(b).all()) for b in buckets))
                estimate_entropy(sample_gradient(buckets, rate), estimator, bins)

            return self.time(one_estimate)

        big, small = self.entropy_elements, max(1, self.entropy_elements // 4)
        t_big, t_small = seconds(big), seconds(small)
        slope = max(0.0, (t_big - t_small) / (big - small)) if big > small else t_big / big
        fixed = max(0.0, t_big - slope * big)
        return EntropyCost(fixed, slope)


class CostProfile:
    """Seconds of EDGC's local arithmetic, by operation and shape, and where they came from.

    - `lowrank[(m, n, r)]`: seconds per matrix of one low-rank round, obtained on a batch of
      `batches[(m, n, r)]` matrices; between known ranks the time is interpolated linearly
      in r, outside them scaled in proportion to r;
    - `entropy[(β, estimator, bins)]`: the GDS cost, fixed + per gradient element.

    Missing entries are filled by `source` (a roofline model or a `DeviceTimer`); with no
    source they raise. `compute_scale` multiplies every time looked up; the stored numbers
    stay as obtained.
    """

    def __init__(self, source: CostSource | None = None, *, compute_scale: float = 1.0) -> None:
        # hyperparameters
        self.source = source
        if not (compute_scale > 0 and compute_scale < float("inf")):
            raise ValueError(f"compute_scale must be positive, got {compute_scale}")
        self.compute_scale = compute_scale
        # internal state: the numbers and their origins
        self.lowrank: dict[tuple[int, int, int], float] = {}  # (m, n, r) -> seconds per matrix
        self.batches: dict[tuple[int, int, int], int] = {}  # (m, n, r) -> batch it was obtained on
        self.entropy: dict[tuple[float, str, int], EntropyCost] = {}  # (β, estimator, bins) -> cost
        self.origins: dict[str, str] = {}  # "roofline:V100-SXM2" / "measured:<device>" -> detail line
        # stats
        self.measured = 0  # entries timed by this object
        self.modelled = 0  # entries computed by a model by this object
        self.fill_seconds = 0.0

    # --- filling

    def _record(self, source: CostSource, entries: int, seconds: float) -> None:
        self.origins[source.origin] = source.detail
        if source.measures:
            self.measured += entries
        else:
            self.modelled += entries
        self.fill_seconds += seconds

    def ensure_lowrank(self, shapes: dict[tuple[int, int], int], ranks: Sequence[int]) -> None:
        """Fill every missing (m, n, min(r, m, n)) for `shapes` {(m, n): count} and `ranks`.

        An exhaustive source (a model) fills every rank from 1 to the largest asked. With no
        source, a shape that has some ranks is interpolated later; a shape with none raises
        ValueError.
        """
        for (m, n), count in sorted(shapes.items()):
            have = {r for (mm, nn, r) in self.lowrank if (mm, nn) == (m, n)}
            wanted = {min(r, m, n) for r in ranks}
            if self.source is not None and self.source.exhaustive and ranks:
                wanted |= set(range(1, min(max(ranks), m, n) + 1))
            todo = sorted(wanted - have)
            if not todo:
                continue
            if self.source is None:
                if have:
                    continue  # interpolated by lowrank_seconds
                raise ValueError(f"the cost profile has no cost for a ({m}, {n}) matrix, and nothing to fill it "
                                 "from: it was made for another model or layout; pass --device cuda (or cpu) "
                                 "to measure what is missing, or --gpu NAME to model it")
            t_start = time.perf_counter()
            for r, seconds in self.source.lowrank(m, n, todo, count).items():
                self.lowrank[(m, n, r)] = seconds / count
                self.batches[(m, n, r)] = count
            self._record(self.source, len(todo), time.perf_counter() - t_start)

    def ensure_entropy(self, rate: float, estimator: str, bins: int) -> None:
        """Fill the GDS cost at β = `rate` unless known; raises ValueError with no source."""
        key = (float(rate), estimator, int(bins))
        if key in self.entropy:
            return
        if self.source is None:
            raise ValueError(f"the cost profile has no GDS cost for gradient_sample_rate={rate}, "
                             f"estimator {estimator!r}, {bins} bins, and nothing to fill it from")
        t_start = time.perf_counter()
        self.entropy[key] = self.source.entropy(rate, estimator, bins)
        self._record(self.source, 1, time.perf_counter() - t_start)

    # --- looking up

    def lowrank_seconds(self, m: int, n: int, rank: int) -> float:
        """Return the scaled seconds of one low-rank round on one (m, n) matrix at `rank`.

        Raises KeyError if (m, n) is unknown.
        """
        r = min(rank, m, n)
        points = sorted((rr, t) for (mm, nn, rr), t in self.lowrank.items() if (mm, nn) == (m, n))
        if not points:
            raise KeyError(f"no cost known for a ({m}, {n}) matrix")
        exact = dict(points)
        if r in exact:
            t = exact[r]
        elif r < points[0][0]:
            t = points[0][1] * r / points[0][0]
        elif r > points[-1][0]:
            t = points[-1][1] * r / points[-1][0]
        else:
            (r0, t0), (r1, t1) = next((a, b) for a, b in pairwise(points) if a[0] < r < b[0])
            t = t0 + (t1 - t0) * (r - r0) / (r1 - r0)
        return t * self.compute_scale

    def entropy_seconds(self, numel: int, rate: float, estimator: str, bins: int) -> float:
        """Return the scaled seconds of one GDS estimate over `numel` gradient elements."""
        return self.entropy[(float(rate), estimator, int(bins))].seconds(numel) * self.compute_scale

    # --- persistence

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form: origins with their details, then the unscaled numbers."""
        return {
            "format": _PROFILE_FORMAT,
            "version": _PROFILE_VERSION,
            "origins": [{"origin": o, "detail": d} for o, d in sorted(self.origins.items())],
            "lowrank": [{"m": m, "n": n, "rank": r, "batch": self.batches.get((m, n, r)), "seconds_per_matrix": t}
                        for (m, n, r), t in sorted(self.lowrank.items())],
            "entropy": [{"gradient_sample_rate": rate, "estimator": est, "bins": bins,
                         "fixed_seconds": c.fixed_seconds, "seconds_per_element": c.seconds_per_element}
                        for (rate, est, bins), c in sorted(self.entropy.items())],
        }

    def save(self, path: str | Path) -> None:
        """Write the numbers (unscaled) and their origins as JSON to `path`."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    def load(self, path: str | Path) -> None:
        """Add the numbers of a JSON file written by `save` (version 1 or 2).

        Raises FileNotFoundError for a missing file, ValueError if it is not a cost profile.
        Version 1 files (measured only, before origins were recorded) keep their "sources"
        strings as measured origins; their entropy cost has no fixed part.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"profile {str(path)!r} does not exist")
        try:
            d = json.loads(path.read_text())
            if d.get("format") != _PROFILE_FORMAT:
                raise ValueError(f"not an {_PROFILE_FORMAT} file")
            version = d.get("version", 1)
            if version not in (1, _PROFILE_VERSION):
                raise ValueError(f"version {version} is not 1 or {_PROFILE_VERSION}")
            for e in d["lowrank"]:
                mnr = (int(e["m"]), int(e["n"]), int(e["rank"]))
                self.lowrank[mnr] = float(e["seconds_per_matrix"])
                if e.get("batch") is not None:
                    self.batches[mnr] = int(e["batch"])
            for e in d["entropy"]:
                key = (float(e["gradient_sample_rate"]), str(e["estimator"]), int(e["bins"]))
                self.entropy[key] = EntropyCost(float(e.get("fixed_seconds", 0.0)), float(e["seconds_per_element"]))
            if version == 1:
                for s in d.get("sources", []):
                    self.origins[f"measured:{s}"] = f"{s} (version-1 profile from {path.name})"
            else:
                for o in d["origins"]:
                    self.origins[str(o["origin"])] = str(o["detail"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"profile {str(path)!r} is not a valid cost profile: {exc}") from None
