"""edgc: Entropy-driven Dynamic Gradient Compression for PyTorch distributed training."""

import torch as _torch

from edgc.extras import check_torch as _check_torch

_check_torch(_torch.__version__)

# (checked before the rest is imported: an older torch fails there in less readable ways)
from edgc.comm import EDGCState, EDGCStats, edgc_hook, log_stats  # noqa: E402
from edgc.config import EDGCConfig  # noqa: E402

__all__ = ["EDGCConfig", "EDGCState", "EDGCStats", "edgc_hook", "log_stats"]
__version__ = "0.2.0"
