"""Run torchtitan 0.3.0 on a CPU with gloo, for the tests of edgc.integrations.torchtitan.

torchtitan assumes CUDA in a few places. `install()` patches each of them, before
torchtitan is imported, and nothing else: the trainer, its parallelisms, its checkpointer
and its metrics run as they do on GPUs. Each patch names the line of torchtitan 0.3.0 it
replaces (paths under site-packages/torchtitan).

Run as a script, it is torchtitan's own entry point with the patches installed:

    torchrun --nproc-per-node 4 tests/distributed/titan_shim.py \
        --module edgc.integrations.torchtitan --config llama3_debugmodel ...

and CPU_FLAGS are the flags a CPU run needs besides. With EDGC_TITAN_RECORD=DIR set, it
also writes what the tests read back (`record`).
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
from typing import Any
from unittest import mock

import torch

#: flags a CPU run needs: float32 compute (no bf16 autocast of FSDP's all-gather), no CUDA
#: graphs, no flight-recorder buffer (a CUDA/NCCL feature)
CPU_FLAGS = ["--training.mixed-precision-param", "float32", "--training.disable-cuda-graphs",
             "--comm.trace-buf-size", "0"]

_installed = False


def install() -> None:
    """Patch torchtitan's CUDA assumptions (idempotent). Call before importing torchtitan."""
    global _installed
    if _installed:
        return
    _installed = True

    # distributed/minimal_async_ep/api.py line 30 imports kernels.py, whose line 10 is
    # `import triton` (pulled in by every model through the MoE token dispatchers). The CPU
    # torch wheel has no triton; those kernels are CUDA-only and never run here, so a
    # stand-in module takes kernels.py's place (not triton's: torch probes for triton).
    if importlib.util.find_spec("triton") is None:
        sys.modules["torchtitan.distributed.minimal_async_ep.kernels"] = mock.MagicMock(
            name="minimal_async_ep.kernels (CUDA only)")

    # tools/utils.py line 55: `device_type = _get_available_device_type() or "cuda"`,
    # then trainer.py's `device_module.set_device(...)`: make the device type "cpu".
    torch._utils._get_available_device_type = lambda: "cpu"  # type: ignore[assignment]

    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.fsdp as fsdp
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.models.common.attention as attention

    # components/metrics.py lines 38-50 (build_device_memory_monitor): torch.cuda's memory
    # statistics. A monitor that reports zeros.
    metrics.build_device_memory_monitor = _ZeroMemoryMonitor

    # distributed/utils.py line 586 (set_pg_timeouts): `barrier(device_ids=[current_device()])`
    # fails on a CPU. The timeouts it shortens are only a hang guard: skip it.
    dist_utils.set_pg_timeouts = lambda *args, **kwargs: None

    # distributed/fsdp.py lines 27-41 (disable_fsdp_gradient_division): a divide factor of 1
    # makes FSDP2 reduce-scatter with PREMUL_SUM, which gloo refuses. Sum, then divide.
    divide = fsdp.disable_fsdp_gradient_division

    def disable_division_then_sum(model: torch.nn.Module) -> None:
        divide(model)
        for module in model.modules():
            if isinstance(module, fsdp.FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    fsdp.disable_fsdp_gradient_division = disable_division_then_sum

    # models/common/attention.py lines 277 and 310 (FlexAttention._compiled_flex_attn):
    # flex attention is compiled by inductor and has no backward on a CPU in eager mode.
    # Causal scaled-dot-product attention stands in for it (the debug models' mask is
    # causal; the document mask of packed samples is dropped).
    attention.FlexAttention._compiled_flex_attn = staticmethod(_causal_sdpa)


def record(out: str) -> None:
    """What the tests read back, written to `out`/rank<R>.json when the trainer closes:
    each logged step's loss and validation loss, edgc's stats (with edgc), this process's coordinates on the
    dp_replicate, fsdp and tp dimensions, and a digest of its parameter shards (equal on
    two replicas only if every shard is bit-identical)."""
    import dataclasses
    import hashlib
    import json
    from pathlib import Path

    import torch.distributed as dist
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.trainer import Trainer

    losses: dict[int, float] = {}
    log = MetricsProcessor.log

    def log_and_record(self: Any, step: int, loss: float, *args: Any, **kwargs: Any) -> None:
        losses[step] = loss
        log(self, step, loss, *args, **kwargs)

    MetricsProcessor.log = log_and_record  # type: ignore[method-assign]
    validation: dict[int, float] = {}
    log_validation = MetricsProcessor.log_validation

    def log_validation_and_record(self: Any, loss: float, step: int, *args: Any, **kwargs: Any) -> None:
        validation[step] = loss
        log_validation(self, loss, step, *args, **kwargs)

    MetricsProcessor.log_validation = log_validation_and_record  # type: ignore[method-assign]
    close = Trainer.close

    def close_and_record(self: Any) -> None:
        digest = hashlib.sha256()
        for _, p in sorted(self.model_parts[0].named_parameters()):
            local = p.to_local() if hasattr(p, "to_local") else p
            digest.update(local.detach().contiguous().numpy().tobytes())
        dims = self.parallel_dims
        coords = {d: (m.get_local_rank() if (m := dims.get_optional_mesh(d)) is not None else 0)
                  for d in ("dp_replicate", "fsdp", "tp")}
        state = getattr(self, "edgc_state", None)
        stats = None if state is None else {k: v for k, v in dataclasses.asdict(state.stats()).items()
                                            if isinstance(v, (int, str)) or v == v}
        record = {"losses": losses, "validation": validation, "coords": coords, "digest": digest.hexdigest(),
                  "edgc": stats, "step": self.step}
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
        close(self)

    Trainer.close = close_and_record  # type: ignore[method-assign]


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                 enable_gqa: bool = False, **_: Any) -> tuple[torch.Tensor, Any]:
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                           enable_gqa=enable_gqa)
    return out, mock.Mock(lse=None)


class _ZeroMemoryMonitor:
    """components/metrics.py's DeviceMemoryMonitor, reporting zeros (no CUDA here)."""

    device_name = "cpu"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def get_peak_stats(self) -> Any:
        return mock.Mock(max_active_gib=0.0, max_active_pct=0.0, max_reserved_gib=0.0, max_reserved_pct=0.0,
                         num_alloc_retries=0, num_ooms=0)

    def reset_peak_stats(self) -> None:
        pass


if __name__ == "__main__":
    install()
    if os.environ.get("EDGC_TITAN_RECORD"):
        record(os.environ["EDGC_TITAN_RECORD"])
    sys.argv[0] = "torchtitan.train"
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
