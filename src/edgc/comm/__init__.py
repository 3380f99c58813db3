"""Where collectives happen: the DDP communication hook and its state."""

from edgc.comm.hook import EDGCState, EDGCStats, edgc_hook
from edgc.comm.stats import log_stats

__all__ = ["EDGCState", "EDGCStats", "edgc_hook", "log_stats"]
