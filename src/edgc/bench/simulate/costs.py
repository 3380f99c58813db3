"""What a source of compression costs provides, whether it models them or times them.

`edgc simulate` needs two numbers from the hardware it projects onto: the seconds of one
PowerSGD round over a batch of same-shape matrices, and the seconds of one GDS entropy
estimate over a stage's gradient. Two sources give them:

- `edgc.bench.simulate.gpu.RooflineModel`: a stated roofline model of a named GPU
  (arithmetic, instant, the default for a cluster that names its GPU);
- `edgc.bench.simulate.profile.DeviceTimer`: the same operations timed on a local device.

`edgc.bench.simulate.profile.CostProfile` caches what a source gave, and saves it as JSON.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["DDP_BUCKET_BYTES", "CostSource", "EntropyCost"]

# torch.nn.parallel.DistributedDataParallel's default bucket_cap_mb=25 (torch docs): the hook
# sees the gradient in buckets of about this size, and the GDS samples bucket by bucket.
DDP_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class EntropyCost:
    """Seconds of one GDS entropy estimate over N gradient elements: fixed + per_element · N."""

    fixed_seconds: float
    """Seconds that do not grow with the gradient (kernel launches, host syncs)."""
    seconds_per_element: float
    """Seconds per gradient element (the passes over the gradient and its sample)."""

    def seconds(self, numel: int) -> float:
        """Return fixed_seconds + seconds_per_element · numel."""
        return self.fixed_seconds + self.seconds_per_element * numel


class CostSource(Protocol):
    """Gives the seconds of EDGC's local arithmetic on some hardware. (Its values are
    read-only properties here, so that a property or a frozen field provides them.)"""

    @property
    def origin(self) -> str:
        """Where the numbers come from: "roofline:<GPU>" or "measured:<device name>"."""
        ...

    @property
    def detail(self) -> str:
        """One line for the report: the assumptions, or how and where it was timed."""
        ...

    @property
    def exhaustive(self) -> bool:
        """True if a cost is cheap to get (a model), so every rank 1..r_max is filled in;
        False (a timer): only the ranks asked for, the others interpolated."""
        ...

    @property
    def measures(self) -> bool:
        """True if it times real work (slow, and reported as a measurement)."""
        ...

    def lowrank(self, m: int, n: int, ranks: Sequence[int], batch: int) -> dict[int, float]:
        """Return {rank: seconds of one round over a batch of `batch` (m, n) matrices}."""
        ...

    def entropy(self, rate: float, estimator: str, bins: int) -> EntropyCost:
        """Return the GDS cost at gradient sample rate β = `rate` with the named estimator."""
        ...
