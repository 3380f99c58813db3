"""Where collectives happen: the DDP communication hook and its state."""

from edgc.comm.hook import EDGCState, EDGCStats, edgc_hook

__all__ = ["EDGCState", "EDGCStats", "edgc_hook"]
