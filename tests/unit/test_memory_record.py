"""The trainer's memory record counts the compression state the hook holds."""

import pytest
import torch

from edgc import EDGCConfig, EDGCState, edgc_hook
from edgc.comm.buckets import sync_with_hook
from edgc.train.trainer import memory_record


@pytest.mark.parametrize("state_dtype", ["native", "bf16"])
def test_state_mb_counts_parameters_optimiser_and_compression_state(state_dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 24), torch.nn.Linear(24, 16))
    opt = torch.optim.Adam(model.parameters())
    state = EDGCState(None, EDGCConfig(policy="static", max_rank=4, warmup="fixed", warmup_steps=1,
                                       state_dtype=state_dtype))
    for _ in range(3):
        model.zero_grad()
        model(torch.randn(8, 32)).square().mean().backward()
        sync_with_hook(list(model.parameters()), state, edgc_hook, cap_bytes=1 << 20)
        opt.step()
    groups = list(state.sync.compression.groups.values())
    assert len(groups) == 2
    size = 2 if state_dtype == "bf16" else 4
    # per matrix (m x n at rank 4): Q (n x 4) and the error feedback (m x n), one buffer;
    # the step's workspace is empty between steps
    compression = sum(size * (n * 4 + m * n) for m, n in ((24, 32), (16, 24)))
    assert state.sync.compression.workspace.nbytes == 0
    assert state.stats().state_bytes == compression
    params = sum(p.numel() * 4 for p in model.parameters())
    record = memory_record(3, model, opt, state, torch.device("cpu"))
    assert round(record["compression_mb"] * 1e6) == compression
    held = round(record["state_mb"] * 1e6)
    steps = sum(s["step"].numel() * s["step"].element_size() for s in opt.state.values())  # (Adam's counters)
    assert held == params + 2 * params + steps + compression  # (Adam: exp_avg and exp_avg_sq)
    assert record["peak_mb"] > 0
