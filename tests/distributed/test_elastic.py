"""Elastic torchrun: two agents of one job on this machine, each a "node" of one worker,
under `--nnodes 1:2 --max-restarts N -m edgc train --auto-resume`. One agent is killed
with SIGKILL mid-run; the survivor meets again alone and finishes the run from its last
checkpoint, on one replica instead of two (docs/checkpoints.md, "Elastic torchrun")."""

import os
import signal
import subprocess
import sys
import time

import pytest

from edgc.train.checkpoint import CHECKPOINT_NAME, load_checkpoint
from edgc.train.launch import free_port
from edgc.train.metrics import read_metrics
from harness import train_args

pytestmark = pytest.mark.slow

RUN = ["--method", "edgc", "--steps", "30", "--checkpoint-every", "5", "--eval-every", "15",
       "--lr-warmup-steps", "3", "--edgc-warmup-steps", "4", "--edgc-window", "3"]


def _agent(data_dir, run, port, cwd):
    """One torchrun agent of the job: a node of one worker, restarting up to 3 times."""
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "edgc-elastic-test",
         "--rdzv-conf", "last_call_timeout=5", "--max-restarts", "3", "--monitor-interval", "0.5",
         "-m", "edgc", *train_args(data_dir, run, *RUN, "--auto-resume")],
        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _train_steps(run):
    path = run / "metrics.jsonl"
    return [r for r in read_metrics(path) if r["kind"] == "train"] if path.exists() else []


def test_the_survivor_of_a_lost_node_meets_again_and_finishes_the_run(tmp_path, data_dir):
    run, port = tmp_path / "run", free_port()
    host = _agent(data_dir, run, port, tmp_path)  # (the first agent hosts the rendezvous store)
    time.sleep(1.0)
    lost = _agent(data_dir, run, port, tmp_path)
    try:
        deadline = time.monotonic() + 240
        while not (run / CHECKPOINT_NAME).exists() or load_checkpoint(run / CHECKPOINT_NAME)["step"] < 10:
            assert time.monotonic() < deadline and host.poll() is None and lost.poll() is None, "no checkpoint"
            time.sleep(0.2)
        assert load_checkpoint(run / CHECKPOINT_NAME)["world_size"] == 2  # both agents met
        os.killpg(lost.pid, signal.SIGKILL)  # the node is lost: its agent, and with it its worker
        _, err = host.communicate(timeout=300)
    finally:
        for proc in (host, lost):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert host.returncode == 0, err[-3000:]
    assert "resumed on 1 replicas from 2" in err
    steps = [r["step"] for r in _train_steps(run)]
    assert steps[-1] == 30 and sorted(set(steps)) == list(range(1, 31))  # every step, to the end
    final = load_checkpoint(run / CHECKPOINT_NAME)
    assert final["step"] == 30 and final["world_size"] == 1 and final["train"]["grad_accum"] == 2
    last = [r for r in _train_steps(run) if r["step"] > 25]
    assert all(r["phase"] == "compress" and r["rank"] > 0 for r in last)
