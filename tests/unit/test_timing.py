"""Device timing: laps on CUDA are events read lazily (CUDA mocked here; no GPU in CI)."""

import pytest
import torch

from edgc.comm import timing
from edgc.comm.pipeline import StageAlignment
from edgc.comm.timing import LapSum, start_lap


class FakeEvent:
    """Stands in for torch.cuda.Event: a stream position whose time is known on completion."""

    clock = 0.0
    synchronized = 0

    def __init__(self) -> None:
        FakeEvent.clock += 0.25  # 250 ms of device work between two events
        self.t = FakeEvent.clock
        self.complete = False

    def query(self) -> bool:
        return self.complete

    def synchronize(self) -> None:
        FakeEvent.synchronized += 1
        self.complete = True

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.complete or end.complete, "elapsed_time needs a completed end event"
        return (end.t - self.t) * 1000.0  # ms, as CUDA reports


@pytest.fixture
def fake_cuda(monkeypatch):
    FakeEvent.clock, FakeEvent.synchronized = 0.0, 0
    monkeypatch.setattr(timing, "_cuda_event", FakeEvent)
    return torch.device("cuda", 0)


def test_cuda_laps_add_up_without_waiting_until_read(fake_cuda):
    total = LapSum()
    for _ in range(3):
        total.add(start_lap(fake_cuda).stop())
    assert FakeEvent.synchronized == 0  # nothing waited for the device while training
    assert float(total) == pytest.approx(0.75)
    assert FakeEvent.synchronized == 3
    assert float(total) == pytest.approx(0.75)  # read once


def test_cpu_laps_use_the_host_clock():
    lap = start_lap(torch.device("cpu")).stop()
    assert lap.done and 0.0 <= float(lap) < 1.0


def test_stage_alignment_reads_its_laps_only_when_it_decides(fake_cuda):
    align = StageAlignment(0, 2, None)
    for _ in range(4):
        align.observe_backward(start_lap(fake_cuda).stop())
        align.observe_compressed(8, start_lap(fake_cuda).stop())
    assert FakeEvent.synchronized == 0
    assert align.t_mb() == pytest.approx(0.25)
    assert align.time_model()(8) == pytest.approx(0.25)
    assert align.state_dict()["backward"] == pytest.approx([0.25] * 4)


def test_lap_sum_folds_finished_laps_as_it_goes(fake_cuda):
    total = LapSum()
    for _ in range(70):
        lap = start_lap(fake_cuda).stop()
        lap._end.complete = True  # the device has caught up
        total.add(lap)
    assert len(total._pending) == 0 and FakeEvent.synchronized == 0
    assert float(total) == pytest.approx(70 * 0.25)
