"""edgc: Entropy-driven Dynamic Gradient Compression for PyTorch distributed training."""

import torch as _torch

from edgc.extras import check_torch as _check_torch

_check_torch(_torch.__version__)

from edgc.comm import EDGCState, EDGCStats, edgc_hook, log_stats
from edgc.config import EDGCConfig

__all__ = ["EDGCConfig", "EDGCState", "EDGCStats", "edgc_hook", "log_stats"]
__version__ = "0.2.0"
