"""`edgc train` as a user runs it: `--log tensorboard` (the events read back, a resumed run
showing each step once), and `--pp 2 --dp 2` without `--nproc` in a terminal, which gets
the summary as a drawn table."""

import json
import os
import pty
import subprocess
import sys

import pytest

from edgc.cli import main
from edgc.train.metrics import read_metrics

pytest.importorskip("tensorboard")  # (an optional extra; scripts/setup.sh installs it)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def _train(data, out, *extra):
    return ["train", "--data", str(data), "--out", str(out), "--batch-size", "4", "--block-size", "32",
            "--eval-tokens", "256", "--no-progress", "--rank", "4", *extra]


def _scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of a TensorBoard folder, as TensorBoard shows it: (step, value) pairs."""
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(1.0, abs(b))  # (TensorBoard keeps float32)


@pytest.mark.slow
def test_log_tensorboard_writes_the_metrics_and_a_resume_shows_each_step_once(tmp_path, data_dir):
    out = tmp_path / "run"
    assert main(_train(data_dir, out, "--log", "tensorboard", "--steps", "5", "--eval-every", "4",
                       "--checkpoint-every", "4", "--keep-checkpoints", "2", "--edgc-warmup-steps", "2",
                       "--edgc-window", "2")) == 0
    records = read_metrics(out / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    board = _scalars(out / "tensorboard")
    for key, tag in (("loss", "train/loss"), ("rank", "train/rank"), ("bytes_sent", "train/bytes_sent"),
                     ("lr", "train/lr")):
        assert [s for s, _ in board[tag]] == [1, 2, 3, 4, 5], tag
        assert all(_close(v, r[key]) for (_, v), r in zip(board[tag], train, strict=True)), tag
    assert [v for _, v in board["train/compressing"]] == [0, 0, 1, 1, 1]  # warm-up, then compressed
    ratios = [r["bytes_uncompressed"] / r["bytes_sent"] for r in train]
    assert all(_close(v, x) for (_, v), x in zip(board["train/compression_ratio"], ratios, strict=True))
    assert ratios[-1] > 2
    assert [s for s, _ in board["train/entropy"]] == [r["step"] for r in train if r["entropy"] is not None]
    val = [r for r in records if r["kind"] == "val"]
    assert [(s, round(v, 5)) for s, v in board["val/loss"]] == [(r["step"], round(r["val_loss"], 5)) for r in val]
    assert [s for s, _ in board["val/loss"]] == [4, 5]

    # Resume from the step-4 checkpoint: step 5 runs again, into a second event file. Its
    # first event is step 5, no earlier than the last one logged, so TensorBoard would keep
    # both step 5s but for the purge step the resumed writer starts with.
    assert main(["train", "--resume", str(out / "checkpoint-0000004.pt"), "--no-progress"]) == 0
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 2
    again = _scalars(out / "tensorboard")
    assert set(again) == set(board)
    for tag, points in again.items():
        steps = [s for s, _ in points]
        assert steps == sorted(set(steps)), tag  # each step once
    assert [s for s, _ in again["train/loss"]] == [1, 2, 3, 4, 5]
    assert [s for s, _ in again["val/loss"]] == [4, 5]
    resumed = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]
    assert all(_close(v, r["loss"]) for (_, v), r in zip(again["train/loss"], resumed, strict=True))

    # a new run in the folder (--overwrite) starts the events afresh, as metrics.jsonl
    assert main(_train(data_dir, out, "--log", "tensorboard", "--steps", "2", "--overwrite")) == 0
    assert [s for s, _ in _scalars(out / "tensorboard")["train/loss"]] == [1, 2]


def _in_a_terminal(args: list[str], cwd, stderr_path) -> tuple[int, str]:
    """Run `python -m edgc ARGS` with its stdout on a pseudo-terminal; returns its exit
    status and what it printed there."""
    leader, follower = pty.openpty()
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "edgc", *args], cwd=cwd, stdin=subprocess.DEVNULL,
                                stdout=follower, stderr=stderr, env={**os.environ, "COLUMNS": "80"})
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # (EIO: the child closed its end)
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    return proc.wait(timeout=300), b"".join(chunks).decode().replace("\r\n", "\n")


@pytest.mark.slow
def test_pp_and_dp_start_their_workers_and_a_terminal_gets_a_drawn_table(tmp_path, data_dir):
    code, shown = _in_a_terminal(_train(data_dir, "run", "--pp", "2", "--dp", "2", "--steps", "3",
                                        "--method", "powersgd", "--edgc-warmup-steps", "1"),
                                 tmp_path, tmp_path / "stderr")
    assert code == 0, (tmp_path / "stderr").read_text()[-3000:]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["world_size"] == 4  # pp(2) * dp(2)
    assert "2 pipeline stages x 2 replicas" in (tmp_path / "run" / "summary.md").read_text()
    # the summary in a terminal: drawn, a column per run at 80 columns, not markdown pipes
    assert "run folder: run" in shown and "─" in shown and "|" not in shown, shown
    rows = [line.split() for line in shown.splitlines()]
    assert ["method", "powersgd"] in rows and ["steps", "3"] in rows, shown
    # the markdown stays in summary.md, and is what a pipe gets
    assert "| run | powersgd | 3 |" in (tmp_path / "run" / "summary.md").read_text()
