"""`edgc train --resume RUN --nproc N`: a DDP run goes on with another number of
replicas, compression still on, and a checkpoint written before the batch stream existed
(each replica's own generator) still resumes exactly."""

import json
import shutil

import pytest

from edgc.cli import main
from edgc.train.checkpoint import CHECKPOINT_NAME, load_checkpoint, save_checkpoint
from edgc.train.metrics import read_metrics
from harness import run_edgc
from harness import train_args as _train

COMMON = ["--method", "edgc", "--steps", "40", "--eval-every", "20", "--checkpoint-every", "20",
          "--lr-warmup-steps", "4", "--edgc-warmup-steps", "6", "--edgc-window", "4", "--nproc", "2"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_dir):
    """A 2-worker run straight through 40 steps, and the same run stopped at step 20."""
    root = tmp_path_factory.mktemp("resize")
    assert main(_train(data_dir, root / "straight", *COMMON)) == 0
    assert main(_train(data_dir, root / "part", *COMMON, "--stop-after", "20")) == 0
    return root


def _records(run, kind):
    return [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == kind]


def _resume(part, stop, steps, *flags, cwd):
    """`edgc train --resume part --stop-after steps FLAGS` as a user runs it; returns its
    stderr and the train records after `stop`, which must be every step to `steps`."""
    proc = run_edgc("train", "--resume", str(part), "--stop-after", str(steps), *flags, "--no-progress", cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    after = [r for r in _records(part, "train") if r["step"] > stop]
    assert [r["step"] for r in after] == list(range(stop + 1, steps + 1))
    return proc.stderr, after


def _assert_within_3_percent(straight, part):
    a, b = (_records(d, "val")[-1]["val_loss"] for d in (straight, part))
    assert abs(b - a) <= 0.03 * a, (b, a)


@pytest.mark.parametrize("nproc,accum", [(1, 2), (4, 1)])
def test_a_2_worker_run_resumes_on_another_number_of_workers(tmp_path, data_dir, runs, nproc, accum):
    part = tmp_path / "part"
    shutil.copytree(runs / "part", part)
    err, after = _resume(part, 20, 40, "--nproc", str(nproc), cwd=tmp_path)
    # the global batch: kept by accumulating 2 micro-batches on 1 replica; doubled on 4
    assert f"resumed on {nproc} replicas from 2 at step 20: {accum} micro-batches a step (was 1)" in err
    assert json.loads((part / "config.json").read_text())["grad_accum"] == accum
    assert all(r["phase"] == "compress" and r["rank"] > 0 for r in after), after  # no second warm-up
    _assert_within_3_percent(runs / "straight", part)
    assert load_checkpoint(part / CHECKPOINT_NAME)["world_size"] == nproc


def test_a_checkpoint_of_each_replicas_generator_resumes_exactly(tmp_path, runs):
    # the checkpoint as edgc wrote it before the batch stream: no "data", each replica's own
    # generator in its entry; with 2 replicas, replica r's is the stream's generator r
    part = tmp_path / "part"
    shutil.copytree(runs / "part", part)
    ckpt = load_checkpoint(part / CHECKPOINT_NAME)
    data = ckpt.pop("data")
    for entry, state in zip(ckpt["replicas"], data["generators"], strict=True):
        entry["generator"] = state
    save_checkpoint(part / CHECKPOINT_NAME, ckpt)
    assert main(["train", "--resume", str(part), "--stop-after", "40", "--no-progress"]) == 0
    a, b = ([(r["step"], r.get("loss"), r.get("val_loss"), r.get("rank")) for r in read_metrics(d / "metrics.jsonl")]
            for d in (runs / "straight", part))
    assert a == b


PIPELINE = ["--method", "edgc", "--pp", "2", "--dp", "2", "--steps", "30", "--eval-every", "15",
            "--checkpoint-every", "15", "--lr-warmup-steps", "3", "--edgc-warmup-steps", "4", "--edgc-window", "3",
            "--activation-rank", "4"]


def test_a_pipeline_resumes_with_fewer_replicas_a_stage(tmp_path, data_dir):
    straight, part = tmp_path / "straight", tmp_path / "part"
    assert main(_train(data_dir, straight, *PIPELINE)) == 0
    assert main(_train(data_dir, part, *PIPELINE, "--stop-after", "15")) == 0
    _, after = _resume(part, 15, 30, "--dp", "1", "--nproc", "2", cwd=tmp_path)
    # no second warm-up (each stage's rank is the DAC's, from measured times: 0 where a
    # stage is sent whole, as in the uninterrupted run, and nothing to send on one replica)
    assert all(r["phase"] == "compress" for r in after), after
    _assert_within_3_percent(straight, part)
    assert load_checkpoint(part / CHECKPOINT_NAME)["layout"] == [2, 1]


HSDP = ["--method", "edgc", "--dp-replicate", "2", "--dp-shard", "1", "--steps", "30", "--eval-every", "15",
        "--checkpoint-every", "15", "--lr-warmup-steps", "3", "--edgc-warmup-steps", "4", "--edgc-window", "3",
        "--device", "cpu"]


def test_an_hsdp_run_resumes_with_fewer_replicas(tmp_path, data_dir):
    straight, part = tmp_path / "straight", tmp_path / "part"
    assert main(_train(data_dir, straight, *HSDP)) == 0
    assert main(_train(data_dir, part, *HSDP, "--stop-after", "15")) == 0
    err, after = _resume(part, 15, 30, "--dp-replicate", "1", "--nproc", "1", cwd=tmp_path)
    assert "resumed on 1 replicas from 2 at step 15: 2 micro-batches a step (was 1)" in err
    assert all(r["phase"] == "compress" and r["rank"] > 0 for r in after), after
    _assert_within_3_percent(straight, part)
    assert load_checkpoint(part / CHECKPOINT_NAME)["hsdp"] == [1, 1]
    # another number of shards is refused in one line
    proc = run_edgc("train", "--resume", str(part), "--stop-after", "30", "--dp-replicate", "1", "--dp-shard", "2",
                    "--nproc", "2", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "--dp-shard 2" in proc.stderr
