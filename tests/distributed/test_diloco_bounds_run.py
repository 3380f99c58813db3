"""benchmarks/diloco_bounds.py through its own door, as the results page runs it: `edgc train
--method edgc-diloco` on 2 spawned workers, the core's warm-up first, then the bound in every
worker."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from edgc.train.checkpoint import CHECKPOINT_NAME
from edgc.train.metrics import read_metrics

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_the_int_bound_replaces_the_core_after_its_warm_up_in_every_worker(tmp_path, data_dir):
    out = tmp_path / "run"
    args = ["--data", str(data_dir), "--out", str(out), "--batch-size", "4", "--block-size", "32",
            "--eval-tokens", "256", "--no-progress", "--rank", "4", "--steps", "16", "--eval-every", "8",
            "--diloco-inner-steps", "4", "--checkpoint-every", "4", "--edgc-warmup", "fixed",
            "--edgc-warmup-steps", "1", "--edgc-window", "2"]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "diloco_bounds.py"), "int:4", "--", *args],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    train = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]
    sent = {r["step"]: r["bytes_sent"] for r in train if r["bytes_sent"] > 0}
    assert list(sent) == [4, 8, 12, 16]
    states = [r["comm"]["diloco"] for r in torch.load(out / CHECKPOINT_NAME, weights_only=False)["replicas"]]
    for a, b in zip(states[0]["global"], states[1]["global"], strict=True):
        assert torch.equal(a, b)  # (the replicas apply the same average)
    numel, tensors = sum(g.numel() for g in states[0]["global"]), len(states[0]["global"])
    # after the core's one outer step of warm-up (whole, int8), each outer step sends the
    # 4-bit codes with their scales, and the outer momentum's coefficients (float32)
    bound = (numel * 4 + 7) // 8 + 2 * ((numel + 31) // 32) + 4 * tensors
    assert sent[8] == sent[12] == sent[16] == bound
    assert sent[4] >= numel  # (the warm-up: a byte an element)
    assert train[-1]["rank"] == 0  # (the core compressed nothing)
