"""edgc: Entropy-driven Dynamic Gradient Compression for PyTorch distributed training."""

from edgc.comm import EDGCState, EDGCStats, edgc_hook
from edgc.config import EDGCConfig

__all__ = ["EDGCConfig", "EDGCState", "EDGCStats", "edgc_hook"]
__version__ = "0.1.0"
