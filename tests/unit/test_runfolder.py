"""The run folder's guards and the checkpoint files: lock, overwrite, leftovers, kept
checkpoints, CRC checks, no checkpoint from a diverged model, and a run that ends diverged
saying so."""

import math
import os

import pytest
import torch

from edgc.cli import main
from edgc.train.checkpoint import kept_checkpoints, load_checkpoint, save_checkpoint
from edgc.train.common import DivergenceGuard, TrainingDiverged
from edgc.train.runfolder import LOCK_NAME, RunFolderBusy, RunLock, check_new_run, clean_leftovers


def test_a_second_lock_on_a_folder_is_refused_until_the_first_is_released(tmp_path):
    run = tmp_path / "run"
    with RunLock(run) as first:
        first.note([11, 12])
        assert "workers 11 12" in (run / LOCK_NAME).read_text()
        with pytest.raises(RunFolderBusy, match=f"pid {os.getpid()}"):
            RunLock(run).acquire()
        with pytest.raises(RunFolderBusy):
            RunLock.check_free(run)
    RunLock.check_free(run)
    with RunLock(run):
        pass


def test_resume_of_a_live_run_without_a_checkpoint_yet_says_it_is_in_use(tmp_path, capsys, monkeypatch):
    # a run that has started but not reached its first checkpoint step: its launcher holds
    # the lock (naming itself and its workers) and has written config.json and metrics
    # (it said "no checkpoint at ...", as if nothing ran there)
    monkeypatch.setattr("edgc.train.trainer.run_local", _no_training)
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    with RunLock(run) as lock:
        lock.note([4242, 4243])
        (run / "config.json").write_text('{"steps": 300}')
        (run / "metrics.jsonl").write_text('{"step": 1, "kind": "train"}\n')
        for argv in (["--resume", str(run)], ["--resume", str(run / "checkpoint.pt")],
                     ["--auto-resume", "--out", str(run)]):
            assert main(["train", *argv, "--no-progress"]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and err.startswith(f"edgc train: error: run folder {str(run)!r} is in use"), err
            assert f"pid {os.getpid()}" in err and "workers 4242 4243" in err
    assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME, "config.json", "metrics.jsonl"]
    # once the run has ended, the same command says what is there
    assert main(["train", "--resume", str(run), "--no-progress"]) == 2
    assert "no checkpoint at" in capsys.readouterr().err


def _no_training(*args, **kwargs):
    raise AssertionError("a refused command reached the workers")


def test_check_free_creates_nothing(tmp_path):
    RunLock.check_free(tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_overwrite_removes_only_run_files(tmp_path):
    for name in ("metrics.jsonl", "checkpoint.pt", "checkpoint-0000010.pt", "loss.png", "notes.txt", "data.png"):
        (tmp_path / name).write_text("x")
    with pytest.raises(ValueError, match="--resume .*--overwrite"):
        check_new_run(tmp_path, overwrite=False)
    check_new_run(tmp_path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.png", "notes.txt"]
    check_new_run(tmp_path, overwrite=False)  # nothing left to refuse


def test_leftovers_of_killed_writes_are_removed(tmp_path):
    (tmp_path / ".checkpoint.pt.abc123.tmp").write_bytes(b"torn")
    (tmp_path / "keep.tmp").write_bytes(b"a user's")
    assert [p.name for p in clean_leftovers(tmp_path)] == [".checkpoint.pt.abc123.tmp"]
    assert [p.name for p in tmp_path.iterdir()] == ["keep.tmp"]


def test_the_newest_checkpoints_are_kept_and_checkpoint_pt_is_the_newest(tmp_path):
    path = tmp_path / "checkpoint.pt"
    for step in (5, 10, 15, 20):
        save_checkpoint(path, {"step": step, "w": torch.full((3,), float(step))}, keep=3)
    assert [p.name for p in kept_checkpoints(tmp_path)] == [f"checkpoint-{s:07d}.pt" for s in (10, 15, 20)]
    assert os.path.samefile(path, tmp_path / "checkpoint-0000020.pt")
    assert load_checkpoint(tmp_path / "checkpoint-0000010.pt")["step"] == 10
    save_checkpoint(path, {"step": 25}, keep=1)  # keep=1: checkpoint.pt alone is written
    assert len(kept_checkpoints(tmp_path)) == 3 and load_checkpoint(tmp_path)["step"] == 25


def test_a_flipped_byte_fails_the_crc_and_the_error_names_older_checkpoints(tmp_path):
    path = tmp_path / "checkpoint.pt"
    for step in (1, 2):
        save_checkpoint(path, {"step": step, "w": torch.randn(10_000)}, keep=2)
    data = bytearray(path.read_bytes())
    os.unlink(path)  # (a fresh inode: the kept link of step 2 keeps its good bytes)
    data[len(data) // 2] ^= 0x01
    path.write_bytes(data)
    with pytest.raises(ValueError, match="fails its checksum.*checkpoint-0000002.pt"):
        load_checkpoint(path)
    assert load_checkpoint(tmp_path / "checkpoint-0000002.pt")["step"] == 2


def test_the_divergence_guard_keeps_the_last_finite_checkpoint_and_says_why(caplog):
    guard = DivergenceGuard(limit=3, run_dir="run", checkpoint_step=None)
    finite, broken = {"w": torch.ones(2)}, {"w": torch.tensor([1.0, math.inf])}
    guard.observe(1, loss=math.nan, grad_norm=1.0)
    assert not guard.may_save(1, finite)
    assert "step 1: no checkpoint written, the loss or gradient norm of this step was not finite " \
           "(no checkpoint was written yet; so for every checkpoint step until one is finite again)" in caplog.text
    guard.observe(2, loss=5.0, grad_norm=1.0)
    assert guard.may_save(2, finite) and guard.checkpoint_step == 2
    guard.observe(3, loss=5.0, grad_norm=1.0)
    assert not guard.may_save(3, broken) and guard.checkpoint_step == 2
    assert "the model's weights are not finite (the last good checkpoint, step 2, is kept;" in caplog.text
    assert not guard.may_save(4, broken) and "step 4" not in caplog.text  # (said once per run of refusals)
    assert len(caplog.records) == 2
    for step in (4, 5):
        guard.observe(step, loss=math.inf, grad_norm=math.nan)
    with pytest.raises(TrainingDiverged, match=r"3 steps in a row \(steps 4-6.*run/checkpoint.pt at step 2"):
        guard.observe(6, loss=5.0, grad_norm=math.inf)


def test_the_divergence_guard_says_whether_a_run_ended_diverged():
    # a run too short for `limit` to stop it: at its end, its last checkpoint refused or its
    # validation loss not finite is a diverged run (it used to end as a finished one)
    finite, broken = {"w": torch.ones(2)}, {"w": torch.tensor([1.0, math.inf])}
    guard = DivergenceGuard(limit=25, run_dir="run", checkpoint_step=None)
    assert guard.verdict(val_loss=None) is None  # (no step yet)
    guard.observe(1, loss=5.0, grad_norm=1.0)
    assert guard.may_save(1, finite) and guard.verdict(val_loss=4.5) is None
    assert guard.verdict(val_loss=math.nan) == (
        "training diverged: the validation loss was not finite at the last step of the run: at step 1, loss 5, "
        "gradient norm 1, validation loss nan; the last good checkpoint is run/checkpoint.pt at step 1")
    guard.observe(2, loss=5.0, grad_norm=1.0)
    assert not guard.may_save(2, broken)
    assert guard.verdict(val_loss=None) == (
        "training diverged: the model's weights were not finite after the last step of the run: at step 2, "
        "loss 5, gradient norm 1; the last good checkpoint is run/checkpoint.pt at step 1")
    guard.observe(3, loss=656201.8125, grad_norm=math.inf)
    assert not guard.may_save(3, finite)
    assert guard.verdict(val_loss=6e5) == (
        "training diverged: the loss or gradient norm was not finite at the last step of the run (its update was "
        "skipped): at step 3, loss 656202, gradient norm inf, validation loss 600000; the last good checkpoint is "
        "run/checkpoint.pt at step 1")
    guard = DivergenceGuard(limit=25, run_dir="run", checkpoint_step=None)
    for step in (1, 2, 3):
        guard.observe(step, loss=math.nan, grad_norm=math.nan)
    assert not guard.may_save(3, finite)
    assert guard.verdict(val_loss=None) == (
        "training diverged: the loss or gradient norm was not finite for the last 3 steps of the run (1-3; updates "
        "were skipped): at step 3, loss nan, gradient norm nan; no checkpoint was written")
    guard.observe(4, loss=5.0, grad_norm=1.0)
    assert guard.may_save(4, finite) and guard.verdict(val_loss=5.0) is None  # (finite again by its end)


def test_a_grad_scaler_skipping_the_last_steps_is_not_a_diverged_run():
    # fp16: the GradScaler skips a step whose gradients overflowed (finite loss, inf norm)
    # while it lowers its scale; a run that happens to end on such a step has not diverged
    finite = {"w": torch.ones(2)}
    for scaled, diverged in ((True, False), (False, True)):
        guard = DivergenceGuard(limit=25, run_dir="run", checkpoint_step=None, loss_scaled=scaled)
        guard.observe(1, loss=5.0, grad_norm=1.0)
        assert guard.may_save(1, finite)
        guard.observe(2, loss=4.9, grad_norm=math.inf)
        assert not guard.may_save(2, finite)  # (the last finite checkpoint, step 1, is kept)
        assert (guard.verdict(val_loss=4.8) is not None) == diverged
    # a non-finite loss is divergence whatever the scaler does
    guard = DivergenceGuard(limit=25, run_dir="run", checkpoint_step=1, loss_scaled=True)
    guard.observe(2, loss=math.nan, grad_norm=math.inf)
    assert not guard.may_save(2, finite)
    assert guard.verdict(val_loss=None).startswith("training diverged: the loss or gradient norm was not finite")
    # and so is a non-finite validation loss
    guard.observe(3, loss=4.0, grad_norm=math.inf)
    assert guard.verdict(val_loss=math.inf).startswith("training diverged: the validation loss was not finite")
