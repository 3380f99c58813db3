"""The examples under examples/, run as the README says (2 CPU processes, 4 for HSDP), then
resumed from the checkpoint they wrote; and the README's DDP quick start, saved to a file
as it stands, run under torchrun."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from edgc.checkpoint import FILE_NAME
from edgc.train.launch import free_port
from harness import assert_same
from readme_snippets import readme_blocks

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


def _torchrun(script: str | Path, *args: str, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
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


def _checkpoint(path: Path) -> dict:
    """A checkpoint of examples/ddp.py, without the EDGC state's timings (seconds differ
    from run to run; everything else must not)."""
    ckpt = torch.load(path, weights_only=True)
    ckpt["edgc"]["stats"] = {k: v for k, v in ckpt["edgc"]["stats"].items() if not k.endswith("_seconds")}
    return ckpt


@pytest.mark.slow
def test_ddp_example_stopped_and_resumed_ends_as_the_uninterrupted_run(tmp_path):
    # 6 steps: total_steps=6 gives a 1-step warm-up and a 5-step window, so the run
    # compresses from step 2; the cut at step 3 falls inside the first window.
    straight = _run(_torchrun("ddp.py", "--steps", "6", "--out", "straight"), tmp_path)
    assert straight[:2] == (5, 6) and straight[3] > 1.0
    first = _run(_torchrun("ddp.py", "--steps", "6", "--stop-after", "3", "--out", "cut"), tmp_path)
    assert first[:2] == (2, 3)
    resumed = _run(_torchrun("ddp.py", "--steps", "6", "--resume", "cut", "--out", "cut"), tmp_path)
    assert resumed == straight
    ends = [_checkpoint(tmp_path / "straight" / f"rank{r}.pt") for r in range(2)]
    for r, end in enumerate(ends):
        assert end["step"] == 6 and end["edgc"]["replica"] == r
        assert_same(_checkpoint(tmp_path / "cut" / f"rank{r}.pt"), end, f"rank{r}.pt")
    assert_same(ends[0]["model"], ends[1]["model"], "the replicas' weights")  # (bit-identical replicas)


@pytest.mark.slow
def test_the_readme_ddp_quick_start_saved_as_a_file_runs_under_torchrun(tmp_path):
    (code,) = [code for (example, _), code in readme_blocks().items() if example == "examples/ddp.py"]
    script = tmp_path / "train.py"
    script.write_text(code)
    compressed, steps, rank, ratio = _run(_torchrun(script, "--steps", "3"), tmp_path)
    assert (compressed, steps) == (2, 3) and rank > 0 and ratio > 1.0
    assert sorted(p.name for p in (tmp_path / "runs" / "ddp").iterdir()) == ["rank0.pt", "rank1.pt"]


@pytest.mark.slow
def test_hsdp_example_accumulates_two_micro_batches_and_syncs_once_a_step(tmp_path):
    # 2 "nodes" of 2: the hook's step counts optimiser steps (one sync each), not micro-batches
    compressed, steps, rank, ratio = _run(_torchrun("hsdp.py", "--shard", "2", "--steps", "4", "--accum", "2",
                                                    nproc=4), tmp_path)
    assert (compressed, steps) == (3, 4) and rank > 0 and ratio > 1.0
