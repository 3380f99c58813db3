"""edgc.integrations with the real frameworks on 2 gloo processes: the hook runs,
replicas stay identical, a resumed run continues the EDGC state exactly, and each
adapter tells the state the learning rate, so that policy "critical" sees a drop."""

from __future__ import annotations

import csv

import pytest
import torch

from edgc.checkpoint import FILE_NAME
from harness import assert_same, run_workers
from integration_workers import (
    DROP_AT,
    DROP_STEPS,
    accelerate_lr_drop_run,
    accelerate_run,
    exact_part,
    lightning_lr_drop_run,
    lightning_run,
    shared_part,
    trainer_lr_drop_run,
    trainer_run,
)


def _check_compressed_and_identical(results: list[dict], steps: int) -> None:
    for r in results:
        stats = r["stats"]
        assert stats.step == steps  # the hook ran once per optimiser step
        assert stats.compressed_steps > 0 and stats.bytes_sent < stats.bytes_uncompressed
    assert torch.equal(results[0]["params"], results[1]["params"])  # replicas bit-identical
    assert_same(shared_part(results[0]["state"]), shared_part(results[1]["state"]), "state")
    assert [r["state"]["replica"] for r in results] == [0, 1]


def _check_resumed_exactly(results: list[dict]) -> None:
    for r in results:
        assert torch.equal(r["resumed_params"], r["params"])
        assert_same(exact_part(r["resumed_state"]), exact_part(r["state"]), "resumed state")


@pytest.mark.smoke
def test_lightning_callback_trains_checkpoints_and_resumes(tmp_path):
    results = run_workers(lightning_run, 2, str(tmp_path), timeout=300)
    _check_compressed_and_identical(results, steps=6)
    _check_resumed_exactly(results)
    # the checkpoint holds both replicas' states, each with its own error feedback
    ckpt = torch.load(tmp_path / "straight" / "step=3.ckpt", weights_only=True)
    replicas = ckpt["callbacks"]["EDGCCallback"]["replicas"]
    assert [s["replica"] for s in replicas] == [0, 1] and replicas[0]["step"] == 3
    # the stats reached Lightning's logger
    with open(tmp_path / "straight" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    ratios = [float(r["edgc/compression_ratio"]) for r in rows if r.get("edgc/compression_ratio")]
    ranks = [float(r["edgc/rank"]) for r in rows if r.get("edgc/rank")]
    assert len(ratios) == 6 and ratios[-1] > 1.0 and ranks[0] == 0.0 and ranks[-1] > 0


@pytest.mark.slow
def test_hf_trainer_callback_trains_checkpoints_and_resumes(tmp_path):
    results = run_workers(trainer_run, 2, str(tmp_path), timeout=300)
    _check_compressed_and_identical(results, steps=6)
    _check_resumed_exactly(results)
    data = torch.load(tmp_path / "checkpoint-3" / FILE_NAME, weights_only=True)
    assert [s["replica"] for s in data["replicas"]] == [0, 1] and data["step"] == 3
    logged = results[0]["logged"]  # the Trainer's log_history, on every logging step
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 6]
    assert all("loss" in r for r in logged)  # (merged into the Trainer's own logs, none lost)
    assert logged[0]["edgc/rank"] == 0.0 and logged[-1]["edgc/rank"] > 0 and logged[-1]["edgc/compression_ratio"] > 1


@pytest.mark.slow
def test_accelerate_helper_trains_saves_and_loads_state(tmp_path):
    results = run_workers(accelerate_run, 2, str(tmp_path), timeout=300)
    _check_compressed_and_identical(results, steps=6)
    _check_resumed_exactly(results)
    data = torch.load(tmp_path / "step-3" / FILE_NAME, weights_only=True)
    assert [s["replica"] for s in data["replicas"]] == [0, 1] and data["step"] == 3
    assert not (tmp_path / "step-3" / "custom_checkpoint_0.pkl").exists()
    logged = results[0]["logged"]
    assert logged[0]["edgc/compressing"] == 0.0 and logged[-1]["edgc/compressing"] == 1.0


def _check_saw_the_drop(results: list[dict], lr: float) -> None:
    """Each step ran at `lr`, a tenth of it from DROP_AT on; the state saw the drop at the
    end of the window holding it (steps 5-6) and ran the next window at r_max = 4, where
    it would run at r_lo = 2 had it not been told the rates; replicas bit-identical."""
    for r in results:
        assert r["lrs"] == pytest.approx([lr] * (DROP_AT - 1) + [lr / 10] * (DROP_STEPS - DROP_AT + 1))
        assert r["stats"].step == DROP_STEPS  # (once per optimizer step)
        assert [rank for rank, _ in r["signals"]] == [0, 0, 4, 4, 2, 2, 4, 4]
        assert [drop for _, drop in r["signals"][1::2]] == [False, False, True, False]  # at the window ends
    assert results[0]["signals"] == results[1]["signals"]
    assert torch.equal(results[0]["params"], results[1]["params"])


@pytest.mark.slow
def test_lightning_callback_tells_the_learning_rate(tmp_path):
    _check_saw_the_drop(run_workers(lightning_lr_drop_run, 2, str(tmp_path), timeout=300), lr=0.2)


@pytest.mark.slow
def test_hf_trainer_callback_tells_the_learning_rate_once_per_accumulated_step(tmp_path):
    _check_saw_the_drop(run_workers(trainer_lr_drop_run, 2, str(tmp_path), timeout=300), lr=1e-2)


@pytest.mark.slow
def test_accelerate_helper_tells_the_optimizers_learning_rate(tmp_path):
    _check_saw_the_drop(run_workers(accelerate_lr_drop_run, 2, str(tmp_path), timeout=300), lr=0.2)
