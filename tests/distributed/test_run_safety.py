"""Never lose a run: the run folder's lock, workers that die with their launcher,
non-finite training, corrupt checkpoints, resume settings, leftovers, restarts and crash
messages, each through `edgc train` as a user runs it (a second process, kill -9)."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from edgc.cli import main
from edgc.train.checkpoint import CHECKPOINT_NAME, kept_checkpoints, load_checkpoint
from edgc.train.metrics import read_metrics
from edgc.train.runfolder import LOCK_NAME
from harness import run_edgc as _edgc
from harness import train_args as _args

#: The run the restart tests interrupt, and train straight through to compare against.
RESTARTED_RUN = ["--steps", "24", "--checkpoint-every", "6", "--eval-every", "12", "--method", "powersgd",
                 "--edgc-warmup-steps", "3"]


def _start(*args, cwd):
    """`edgc train ...` in the background, in its own session (so a kill reaches only it)."""
    return subprocess.Popen([sys.executable, "-m", "edgc", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for(predicate, timeout=120.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _kill_mid_run(proc, run, step, victim, timeout):
    """Once `run` passes `step`, SIGKILL the pid `victim(run)` returns; wait for `proc` to
    end and return its stderr (whatever happens, nothing of `proc` is left running)."""
    try:
        _wait_for(lambda: _last_step(run) >= step, what=f"the run to pass step {step}")
        os.kill(victim(run), signal.SIGKILL)
        return proc.communicate(timeout=timeout)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _workers(run):
    """The worker pids the lock file names (empty until the workers run)."""
    text = (run / LOCK_NAME).read_text() if (run / LOCK_NAME).exists() else ""
    return [int(p) for p in text.split("workers")[1].split()] if "workers" in text else []


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (killed, not yet reaped by its parent) counts as dead
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def _last_step(run):
    path = run / "metrics.jsonl"
    steps = [r["step"] for r in read_metrics(path) if r["kind"] == "train"] if path.exists() else []
    return steps[-1] if steps else 0


def _one_line(stderr):
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("WARNING")]
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1, stderr
    return lines[0]


def _final_val(run):
    return [r["val_loss"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "val"][-1]


def _listed_files(stdout):
    """The files the "run folder: RUN  (...)" line of `edgc train` lists."""
    line = next(line for line in stdout.splitlines() if line.startswith("run folder: "))
    return line.rsplit("(", 1)[1].rstrip(")").split(", ")


@pytest.mark.slow
def test_second_writer_is_refused_and_workers_die_with_a_killed_launcher(tmp_path, data_dir):
    run = tmp_path / "run"
    proc = _start(*_args(data_dir, run, "--steps", "5000", "--checkpoint-every", "5"), cwd=tmp_path)
    try:
        _wait_for(lambda: _last_step(run) >= 6, what="the run to pass step 6")
        workers = _workers(run)
        assert len(workers) == 2 and all(_alive(p) for p in workers)
        # a second writer, new run or resume, is refused while the first runs
        for extra in (["--overwrite"], []):
            second = _edgc(*_args(data_dir, run, "--steps", "20", *extra), cwd=tmp_path)
            assert second.returncode == 2 and "in use by another edgc process" in _one_line(second.stderr)
        second = _edgc("train", "--resume", str(run), "--no-progress", cwd=tmp_path)
        assert second.returncode == 2 and "in use by another edgc process" in second.stderr
        # SIGKILL the launcher alone: its workers go with it, and stop writing
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        _wait_for(lambda: not any(_alive(p) for p in workers), timeout=30, what="the orphaned workers to die")
        step = _last_step(run)
        time.sleep(2)
        assert _last_step(run) == step
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # the lock went with the launcher: the run resumes, and metrics stay in order, once each
    ckpt = load_checkpoint(run)["step"]
    assert main(["train", "--resume", str(run), "--steps", str(ckpt + 3), "--no-progress"]) == 0
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"]
    assert steps == list(range(1, ckpt + 4))


@pytest.mark.slow
def test_kill_one_worker_then_the_job_restarts_and_ends_as_an_uninterrupted_run(tmp_path, data_dir):
    common = RESTARTED_RUN
    assert main(_args(data_dir, tmp_path / "straight", *common)) == 0
    run = tmp_path / "restarted"
    proc = _start(*_args(data_dir, run, *common, "--max-restarts", "1", "--keep-checkpoints", "3"), cwd=tmp_path)
    stderr = _kill_mid_run(proc, run, 9, lambda run: _workers(run)[1], timeout=300)
    assert proc.returncode == 0, stderr
    assert "worker 1 was killed by SIGKILL" in stderr and "restarting from the checkpoint at step" in stderr
    assert _final_val(run) == _final_val(tmp_path / "straight")
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"]
    assert steps == list(range(1, 25))
    # the newest 3 checkpoints are kept; checkpoint.pt is the newest
    assert [p.name for p in kept_checkpoints(run)] == [f"checkpoint-{s:07d}.pt" for s in (12, 18, 24)]
    assert os.path.samefile(run / CHECKPOINT_NAME, run / "checkpoint-0000024.pt")
    # an older one resumes, and the run continues from it to the same end
    assert main(["train", "--resume", str(run / "checkpoint-0000012.pt"), "--no-progress"]) == 0
    assert _final_val(run) == _final_val(tmp_path / "straight")


def test_a_dead_worker_gives_one_line_naming_it_and_how_to_resume(tmp_path, data_dir):
    run = tmp_path / "run"
    proc = _start(*_args(data_dir, run, "--steps", "5000", "--checkpoint-every", "4", "--method", "none"),
                  cwd=tmp_path)
    stderr = _kill_mid_run(proc, run, 5, lambda run: _workers(run)[1], timeout=120)
    assert proc.returncode == 1
    line = _one_line(stderr)
    assert "worker 1 was killed by SIGKILL at step" in line
    assert f"edgc train --resume {run}" in line and "errors.log" in line
    # the log holds the launcher's account (a worker killed by SIGKILL has no traceback of
    # its own; its peer's appears only if the peer reported before the launcher stopped it)
    assert "worker 1 was killed by SIGKILL at step" in (run / "errors.log").read_text()


def test_divergence_stops_the_run_and_keeps_the_last_finite_checkpoint(tmp_path, data_dir):
    run = tmp_path / "run"
    proc = _edgc(*_args(data_dir, run, "--steps", "40", "--lr", "1e30", "--checkpoint-every", "1",
                        "--eval-every", "1", "--max-nonfinite-steps", "3", "--method", "none"), cwd=tmp_path)
    assert proc.returncode == 1
    line = _one_line(proc.stderr)
    assert "training diverged" in line and "3 steps in a row" in line
    ckpt = load_checkpoint(run)
    assert ckpt["step"] == 1 and all(torch.isfinite(t).all() for t in ckpt["model"].values())
    assert f"checkpoint.pt at step {ckpt['step']}" in line
    assert _last_step(run) == 4  # stopped there, not at step 40
    # what it wrote is kept, with a summary, and the run folder line names only files it holds
    assert (run / "summary.md").is_file()
    assert _listed_files(proc.stdout) == ["summary.md", "metrics.jsonl", "plots", "checkpoint.pt"]
    # summaries and reports handle a run without a finite validation loss
    assert main(["report", str(run), "--out", str(tmp_path / "report")]) == 0
    assert "not finite" in (tmp_path / "report" / "report.md").read_text()


def test_a_loss_too_large_for_exp_still_gives_a_summary_and_a_report(tmp_path, data_dir):
    # --lr 1000: the loss stays finite, but exp() of it overflows (the perplexity); the
    # gradient norm does not stay finite, so the run ends diverged (exit 1), its files kept.
    # (At --lr 100 the norm reached 6e13 and stayed finite with tokenizers 0.23.3's BPE of
    # the test corpus: the margin to float32's range depends on the tokens.)
    run = tmp_path / "run"
    proc = _edgc(*_args(data_dir, run, "--steps", "3", "--lr", "1000", "--eval-every", "1", "--method", "none"),
                 cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "Overflow" not in proc.stderr and "training diverged" in _one_line(proc.stderr)
    val = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "val"]
    assert len(val) == 3 and val[0]["val_loss"] > 710 and val[0]["val_ppl"] is None  # (inf, logged as null)
    assert "| none | 3 |" in (run / "summary.md").read_text()
    proc = _edgc("report", str(run), "--out", str(tmp_path / "report"), cwd=tmp_path)
    assert proc.returncode == 0 and "| inf |" in (tmp_path / "report" / "report.md").read_text(), proc.stderr


def test_a_short_run_that_ends_diverged_exits_1_and_lists_only_the_files_it_wrote(tmp_path, data_dir):
    # too few steps for --max-nonfinite-steps (25) to stop it: it ran to its end with every
    # checkpoint refused as not finite (it used to exit 0 and list a checkpoint.pt it never wrote)
    run = tmp_path / "run"
    proc = _edgc(*_args(data_dir, run, "--nproc", "1", "--steps", "6", "--lr", "1000", "--checkpoint-every", "2",
                        "--eval-every", "3", "--method", "none"), cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    line = _one_line(proc.stderr)
    assert line.startswith("edgc train: error: training diverged: ") and "Traceback" not in proc.stdout
    last = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"][-1]
    assert last["step"] == 6 and last["grad_norm"] is None  # (not finite: logged as null)
    assert f"at step 6, loss {last['loss']:.6g}" in line, line
    assert "no checkpoint was written" in line and f"{run / 'summary.md'}" in line, line
    assert not (run / CHECKPOINT_NAME).exists() and (run / "summary.md").is_file()
    assert _listed_files(proc.stdout) == ["summary.md", "metrics.jsonl", "plots"]


def test_a_corrupt_checkpoint_is_refused_on_load(tmp_path, data_dir):
    run = tmp_path / "run"
    assert main(_args(data_dir, run, "--steps", "4", "--stop-after", "2", "--method", "none")) == 0
    path = run / CHECKPOINT_NAME
    data = bytearray(path.read_bytes())
    middle = len(data) // 2  # inside the tensor data
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    path.write_bytes(data)
    proc = _edgc("train", "--resume", str(run), "--stop-after", "null", cwd=tmp_path)
    assert proc.returncode == 2 and "fails its checksum" in _one_line(proc.stderr)


def test_resume_uses_the_checkpoint_settings_and_refuses_changed_ones(tmp_path, data_dir):
    run = tmp_path / "run"
    assert main(_args(data_dir, run, "--steps", "8", "--stop-after", "3", "--method", "powersgd")) == 0
    (run / "config.json").unlink()  # the checkpoint holds the settings
    proc = _edgc("train", "--resume", str(run), "--rank", "16", cwd=tmp_path)
    assert proc.returncode == 2
    line = _one_line(proc.stderr)
    assert "--rank 16 (the run's: 4)" in line and "only these may change" in line
    # stopped by --stop-after: nothing to resume, and the message says how to go on
    proc = _edgc("train", "--resume", str(run), cwd=tmp_path)
    assert proc.returncode == 2 and "--stop-after null" in _one_line(proc.stderr)
    assert main(["train", "--resume", str(run), "--stop-after", "null"]) == 0
    assert _last_step(run) == 8  # the run's own 8 steps, not the default 300
    assert json.loads((run / "config.json").read_text())["steps"] == 8


def test_new_run_refuses_a_folder_with_metrics_unless_overwrite(tmp_path, data_dir):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "kind": "train"}\n')
    (run / "notes.txt").write_text("mine")
    proc = _edgc(*_args(data_dir, run, "--steps", "2", "--method", "none"), cwd=tmp_path)
    assert proc.returncode == 2 and "--overwrite" in _one_line(proc.stderr)
    assert (run / "metrics.jsonl").read_text() == '{"step": 1, "kind": "train"}\n'
    # leftovers of a killed writer and of a killed launcher go on the next start
    (run / ".checkpoint.pt.x1y2.tmp").write_bytes(b"torn")
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = Path(tempfile.gettempdir()) / f"edgc-workers-{dead.pid}-abc"
    stale.mkdir(exist_ok=True)
    assert main(_args(data_dir, run, "--steps", "2", "--method", "none", "--overwrite")) == 0
    assert _last_step(run) == 2 and (run / "notes.txt").read_text() == "mine"
    assert not (run / ".checkpoint.pt.x1y2.tmp").exists() and not stale.exists()


@pytest.mark.slow
def test_torchrun_restarts_with_auto_resume_and_ends_as_an_uninterrupted_run(tmp_path, data_dir):
    from edgc.train.launch import free_port

    common = RESTARTED_RUN
    assert main(_args(data_dir, tmp_path / "straight", *common)) == 0
    run = tmp_path / "restarted"
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
         "--master-port", str(free_port()), "-m", "edgc", *_args(data_dir, run, *common, "--auto-resume")],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    # (under torchrun the lock holder is rank 0: "pid N, since ...")
    stderr = _kill_mid_run(proc, run, 9, lambda run: int((run / LOCK_NAME).read_text().split()[1].rstrip(",")),
                           timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert _final_val(run) == _final_val(tmp_path / "straight")
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"] == list(range(1, 25))
