"""The emulated device time of `edgc train --emulated-device-ms` (edgc.train.emulate)."""

import torch

from edgc.models import build_model
from edgc.train import emulate


def test_each_block_waits_forward_then_twice_backward_and_the_gradients_are_unchanged(monkeypatch):
    slept = []
    monkeypatch.setattr(emulate.time, "sleep", slept.append)
    idx = torch.randint(0, 64, (2, 16))
    grads = []
    for ms in (0.0, 7.0):
        torch.manual_seed(0)
        model = build_model("tiny", vocab_size=64, block_size=16)
        emulate.emulate_device_time(model.h, ms)
        _, loss = model(idx, idx)
        assert slept == ([0.007] * 4 if ms else [])  # one wait per block, forward
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
    assert slept == [0.007] * 4 + [0.014] * 4  # then twice as long per block, backward
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_a_compiled_block_still_waits_and_its_graph_holds_no_wait(monkeypatch):
    # `edgc train --compile --emulated-device-ms`: the wait runs outside the blocks' graphs
    slept = []
    monkeypatch.setattr(emulate.time, "sleep", slept.append)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=64, block_size=16)
    for block in model.h:
        block.compile(backend="aot_eager", fullgraph=False)
    emulate.emulate_device_time(model.h, 7.0)
    torch._dynamo.utils.counters.clear()
    idx = torch.randint(0, 64, (2, 16))
    _, loss = model(idx, idx)
    loss.backward()
    assert slept == [0.007] * 4 + [0.014] * 4
    # one graph, the block's, shared by the four: the wait is left to run eagerly, not
    # traced into a second graph (or, with the real time.sleep, a graph break and a warning)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
