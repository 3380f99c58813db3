"""Where collectives happen: the compression core and its adapters (the DDP hook here)."""

from edgc.comm.hook import EDGCState, edgc_hook
from edgc.comm.stats import EDGCStats, log_stats

__all__ = ["EDGCState", "EDGCStats", "edgc_hook", "log_stats"]
