"""edgc.integrations in one process: the logged values, the learning rate told to the
state, an ImportError that names the missing extra, and a clear error where a framework
would register a second hook."""

import math
import sys

import pytest
import torch

from edgc.comm.hook import EDGCState, EDGCStats
from edgc.config import EDGCConfig
from edgc.integrations import _tell_learning_rate, log_values


def test_log_values_are_floats_and_leave_out_an_unknown_entropy():
    stats = EDGCStats(step=3, phase="compress", rank=4, step_phase="compress", step_rank=4, entropy=math.nan,
                      min_rank=1, max_rank=8, bytes_sent=100, bytes_uncompressed=400, compress_seconds=0.0,
                      comm_seconds=0.0, entropy_seconds=0.0, nonfinite_steps=0, compressed_steps=2)
    assert log_values(stats) == {"edgc/rank": 4.0, "edgc/compressing": 1.0, "edgc/compression_ratio": 4.0,
                                 "edgc/bytes_sent": 100.0}
    stats.entropy, stats.step_phase = -3.5, "warmup"
    assert log_values(stats, prefix="")["entropy"] == -3.5 and log_values(stats)["edgc/compressing"] == 0.0


def test_the_learning_rate_told_is_the_largest_of_every_param_group():
    state = EDGCState(None, EDGCConfig(policy="critical"))
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    sgd = torch.optim.SGD([{"params": a.parameters(), "lr": 0.1}, {"params": b.weight, "lr": 0.0},
                           {"params": b.bias, "lr": torch.tensor(0.3)}])  # (a frozen group, a tensor rate)
    adam = torch.optim.Adam(a.parameters(), lr=0.2)
    assert _tell_learning_rate(state, [sgd, adam]) == pytest.approx(0.3)
    assert state.sync.policy.rule.lr == pytest.approx(0.3)
    adam.param_groups[0]["lr"] = None  # (an optimizer that sizes its own steps: nothing to tell)
    assert _tell_learning_rate(state, [adam]) is None and state.sync.policy.rule.lr == pytest.approx(0.3)
    assert _tell_learning_rate(state, [adam, sgd]) == pytest.approx(0.3)


@pytest.mark.parametrize("module, framework, extra", [
    ("edgc.integrations.lightning", "lightning", "lightning"),
    ("edgc.integrations.hf", "transformers", "hf"),
    ("edgc.integrations.hf", "accelerate", "hf"),
])
def test_an_integration_without_its_framework_names_the_extra(monkeypatch, module, framework, extra):
    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setitem(sys.modules, framework, None)  # (import of it fails, as when not installed)
    if framework == "accelerate":
        monkeypatch.setitem(sys.modules, "transformers", type(sys)("transformers"))  # (found, so accelerate is next)
    message = rf'needs {framework!r}, which could not be imported.*pip install "edgc\[{extra}\]"'
    with pytest.raises(ImportError, match=message):
        __import__(module)


def test_accelerate_with_its_own_comm_hook_is_refused():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    from edgc.integrations.hf import register_edgc

    handler = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.POWER_SGD)
    accelerator = Accelerator(cpu=True, kwargs_handlers=[handler])
    try:
        with pytest.raises(ValueError, match="already registers a hook"):
            register_edgc(accelerator, torch.nn.Linear(2, 2))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # (Accelerate keeps it process-wide)
