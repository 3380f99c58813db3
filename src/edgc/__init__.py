"""edgc: Entropy-driven Dynamic Gradient Compression for PyTorch distributed training."""

from edgc.comm import EDGCState, EDGCStats, edgc_hook, log_stats
from edgc.config import EDGCConfig

__all__ = ["EDGCConfig", "EDGCState", "EDGCStats", "edgc_hook", "log_stats"]
__version__ = "0.2.0"
