"""SyncState: what a user reads and sets on an EDGC state, whatever the engine.

The DDP adapter (edgc.comm.hook.EDGCState) and the FSDP2 one (edgc.fsdp.EDGCFSDPState)
wrap the same compression core (edgc.comm.sync.GradientSync, `sync`) and differ only in
how buffers reach it and how their state is saved. What is the same on both lives here,
once: the config, the on/off switch, the step, phase and rank, the stats, and the two
knobs a training loop sets each step.
"""

from __future__ import annotations

from edgc.comm.stats import EDGCStats
from edgc.comm.sync import GradientSync
from edgc.config import EDGCConfig

__all__ = ["SyncState"]


class SyncState:
    """The user-facing part of an EDGC state over one compression core (`sync`)."""

    sync: GradientSync

    @property
    def config(self) -> EDGCConfig:
        return self.sync.config

    @property
    def enabled(self) -> bool:
        """Whether the hook compresses. Set False (between steps, alike on every replica)
        and each buffer is averaged by one plain all-reduce in its own dtype, as the engine
        does without a hook (under HSDP: over the replicate group): no compression, no
        quantization, and nothing of this state changes (step count and stats included).
        Set True again and compression goes on where it stopped, the error feedback's
        residual with it."""
        return self.sync.enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        self.sync.enabled = bool(on)

    @property
    def step(self) -> int:
        """The steps synchronised so far."""
        return self.sync.step

    @property
    def phase(self) -> str:
        """"warmup" (sent whole) or "compress"."""
        return self.sync.phase

    @property
    def rank(self) -> int:
        """The rank used for compressed steps now (0 while uncompressed)."""
        return self.sync.rank

    def stats(self) -> EDGCStats:
        """A snapshot of this process's counters (EDGCStats)."""
        return self.sync.stats()

    def set_grad_scale(self, scale: float) -> None:
        """The loss scale the next gradients carry (GradScaler.get_scale())."""
        self.sync.set_grad_scale(scale)

    def set_learning_rate(self, lr: float) -> None:
        """The learning rate of the next step (read by policies that ask for it)."""
        self.sync.set_learning_rate(lr)
