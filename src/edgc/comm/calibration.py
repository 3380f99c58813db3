"""r_max calibration (the released code's): time compressed against uncompressed sums
during warm-up, one probe rank per step, until compression stops paying.

Used when EDGCConfig.max_rank is None. Each warm-up step times its own uncompressed sum,
and `calibration_repeats` compressed rounds at the next probe rank (2, 4, 8, ...) on a
copy of its gradient, without touching any state. Both travel in the wire format
(EDGCConfig.wire), as the steps they stand for do. Times are agreed as the maximum over
replicas, so every replica reaches the same r_max. On CUDA the probe is
timed with events and read at once (a decision needs it; warm-up only).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from edgc.comm.collectives import Collectives
from edgc.comm.timing import start_lap
from edgc.comm.units import flatten_by_dtype, scatter
from edgc.comm.wire import alignment
from edgc.compress import compressible, draw_q, orthogonalize_, project_p, project_q
from edgc.policy.calibration import calibrated_max_rank, probe_ranks

__all__ = ["Calibration"]

logger = logging.getLogger(__name__)


class Calibration:
    """The probes measured so far, and whether r_max is known."""

    def __init__(self, known: bool, seed: int, repeats: int, min_compression_rate: float) -> None:
        self.points: list[tuple[int, float]] = []  # (rank, seconds of a compressed round)
        self.t_uncompressed: list[float] = []  # seconds of the same steps' plain all-reduce
        self.done = known
        self.seed = seed
        self.repeats = repeats
        self.min_compression_rate = min_compression_rate

    def observe(self, grads: list[torch.Tensor], t_plain: float, collectives: Collectives, wire: str
                ) -> int | None:
        """Probe the next rank on this step's gradient (`t_plain`: its uncompressed sum's
        seconds), its factors summed in the wire format `wire` as the uncompressed sum was;
        returns r_max once calibration is done, else None."""
        mats_all = [g for g in grads if g.dim() >= 2]
        cap = max((min(int(g.shape[0]), g[0].numel()) for g in mats_all), default=0)
        ranks = probe_ranks(cap) if cap else []
        k = len(self.points)
        if k >= len(ranks):
            return self._finish(cap)
        r = ranks[k]
        mats = [g.reshape(g.shape[0], -1) for g in mats_all if compressible(g.shape, r, self.min_compression_rate)]
        if not mats:
            return self._finish(cap)
        generator = torch.Generator().manual_seed(self.seed + 1 + k)
        lap = start_lap(collectives.device)
        for _ in range(self.repeats):
            _probe_round(mats, r, generator, collectives, wire)
        t_probe = float(lap.stop()) / self.repeats
        times = torch.tensor([t_plain, t_probe], dtype=torch.float64)
        # collective: all-reduce MAX of two float64 timings (16 bytes)
        collectives.all_reduce(times, op=dist.ReduceOp.MAX, device_copy=grads[0].device, control=True)
        self.t_uncompressed.append(float(times[0]))
        self.points.append((r, float(times[1])))
        logger.info("EDGC calibration: rank %s compressed %.4fs vs uncompressed %.4fs", r, times[1], times[0])
        if float(times[1]) >= float(times[0]) or k + 1 >= len(ranks):
            return self._finish(cap)
        return None

    def _finish(self, rank_cap: int) -> int:
        if self.points:
            r_max = calibrated_max_rank(self.points, sum(self.t_uncompressed) / len(self.t_uncompressed))
        else:
            r_max = 4
        if rank_cap:
            r_max = min(r_max, max(1, rank_cap))
        self.done = True
        logger.info("EDGC calibration done: r_max %s (points %s)", r_max, self.points)
        return r_max

    def state_dict(self) -> dict[str, Any]:
        return {"points": [list(p) for p in self.points], "t_uncompressed": list(self.t_uncompressed),
                "done": self.done}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.points = [(int(r), float(t)) for r, t in d["points"]]
        self.t_uncompressed = [float(t) for t in d["t_uncompressed"]]
        self.done = bool(d["done"])


def _probe_round(mats: list[torch.Tensor], rank: int, generator: torch.Generator, collectives: Collectives,
                 wire: str) -> None:
    """One timed compressed round (the sums of P and of Q, one buffer per dtype each, in
    the wire format) whose result is thrown away."""
    align = alignment(wire)
    ps = []
    for m in mats:
        q = draw_q(1, m.shape[1], min(rank, *m.shape), generator, dtype=m.dtype, device=m.device)
        ps.append(project_p(m.unsqueeze(0), q))
    p_flats = flatten_by_dtype(ps, range(len(ps)), align)
    # collectives (calibration only): sum of P, one per dtype, in the wire format
    collectives.wait([collectives.sum_in(flat, wire) for flat, _ in p_flats])
    scatter([flat for flat, _ in p_flats], [[ps[i] for i in idx] for _, idx in p_flats], align)
    qs = [project_q(m.unsqueeze(0), orthogonalize_(p)) for m, p in zip(mats, ps, strict=True)]
    # collectives (calibration only): sum of Q, one per dtype, in the wire format
    collectives.wait([collectives.sum_in(flat, wire) for flat, _ in flatten_by_dtype(qs, range(len(qs)), align)])
