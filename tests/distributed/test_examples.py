"""The examples under examples/, run as the README says (2 CPU processes), then resumed from
the checkpoint they wrote."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from edgc.checkpoint import FILE_NAME
from edgc.train.launch import free_port

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SUMMARY = re.compile(r"EDGC: (\d+) of (\d+) steps compressed, last at rank (\d+), ([\d.]+)x fewer bytes")


def _run(cmd: list[str], cwd: Path) -> tuple[int, int, int, float]:
    """Run an example; returns its summary line's (compressed steps, steps, rank, ratio)."""
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    found = SUMMARY.findall(proc.stdout)
    assert len(found) == 1, proc.stdout[-2000:]  # (printed once, by rank 0)
    compressed, steps, rank, ratio = found[0]
    return int(compressed), int(steps), int(rank), float(ratio)


def _torchrun(script: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
            str(free_port()), str(EXAMPLES / script), *args]


def _check(first, resumed) -> None:
    # warm-up is 5 steps in the examples: 10 steps, then 4 more after resuming at step 10
    assert first[:2] == (5, 10) and first[2] > 0 and first[3] > 1.0
    assert resumed[:2] == (9, 14) and resumed[3] > first[3]


def _replicas(path: Path) -> list[int]:
    return [s["replica"] for s in torch.load(path, weights_only=False)["replicas"]]


@pytest.mark.slow
def test_lightning_example(tmp_path):
    script = [sys.executable, str(EXAMPLES / "lightning_ddp.py")]  # (Lightning starts the second process)
    first = _run([*script, "--steps", "10", "--out", "run"], tmp_path)
    ckpt = tmp_path / "run" / "checkpoints" / "step=10.ckpt"
    states = torch.load(ckpt, weights_only=True)["callbacks"]["EDGCCallback"]["replicas"]
    assert [s["replica"] for s in states] == [0, 1]
    resumed = _run([*script, "--steps", "14", "--out", "run", "--resume", str(ckpt)], tmp_path)
    _check(first, resumed)


@pytest.mark.slow
def test_hf_trainer_example(tmp_path):
    first = _run(_torchrun("hf_trainer.py", "--steps", "10", "--out", "run"), tmp_path)
    assert _replicas(tmp_path / "run" / "checkpoint-10" / FILE_NAME) == [0, 1]
    resumed = _run(_torchrun("hf_trainer.py", "--steps", "14", "--out", "run", "--resume", "run/checkpoint-10"),
                   tmp_path)
    _check(first, resumed)


@pytest.mark.slow
def test_accelerate_example(tmp_path):
    first = _run(_torchrun("accelerate_loop.py", "--steps", "10", "--out", "run"), tmp_path)
    assert _replicas(tmp_path / "run" / "step-10" / FILE_NAME) == [0, 1]
    resumed = _run(_torchrun("accelerate_loop.py", "--steps", "14", "--out", "run", "--resume", "run/step-10"),
                   tmp_path)
    _check(first, resumed)
