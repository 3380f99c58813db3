"""`stats().state_bytes` is what the hook's state holds: every tensor reachable from the
state object, each storage once, counted from outside the library (the model's parameters
and gradients left out)."""

import importlib.util
from pathlib import Path

import pytest
import torch

from edgc import EDGCConfig, EDGCState, edgc_hook
from edgc.comm.buckets import sync_with_hook

# the count benchmarks/state_memory.py measures edgc and torch's hook with, used as it is
_SPEC = importlib.util.spec_from_file_location(
    "state_memory", Path(__file__).resolve().parents[2] / "benchmarks" / "state_memory.py")
assert _SPEC is not None and _SPEC.loader is not None
_BENCH = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_BENCH)


@pytest.mark.parametrize("options", [
    dict(policy="noise"), dict(policy="critical"), dict(policy="static", wire="native"),
    dict(policy="static", state_dtype="bf16"),
])
def test_state_bytes_is_every_tensor_the_state_holds(options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 24), torch.nn.Linear(24, 16))
    state = EDGCState(None, EDGCConfig(max_rank=4, warmup="fixed", warmup_steps=1, iteration_sample_rate=1.0,
                                       window=2, **options))
    for _ in range(5):
        model.zero_grad()
        model(torch.randn(8, 32)).square().mean().backward()
        sync_with_hook(list(model.parameters()), state, edgc_hook, cap_bytes=1 << 20)
    exclude = {t.untyped_storage().data_ptr() for p in model.parameters() for t in (p, p.grad)}
    held = state.stats().state_bytes
    assert held > 0 and held == _BENCH.reachable_bytes(state, exclude)
