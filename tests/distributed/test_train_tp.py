"""`edgc train --tp` end to end, as the README writes it: 4 local gloo workers, 2 replicas x
2 TP ranks, on the small test corpus."""

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from edgc.bench.simulate import SimOptions, compressed_matrices, stage_gradients
from edgc.cli import main
from edgc.config import EDGCConfig
from edgc.models import build_model
from edgc.train.blocks import load_block_losses
from edgc.train.checkpoint import CHECKPOINT_NAME
from edgc.train.launch import free_port
from edgc.train.metrics import read_metrics

pytestmark = pytest.mark.slow

COMMON = ["--batch-size", "4", "--block-size", "32", "--eval-tokens", "256", "--no-progress", "--rank", "4",
          "--preset", "tiny"]


def _train(data_dir, out, *extra):
    assert main(["train", "--data", str(data_dir), "--out", str(out), *COMMON, *extra]) == 0
    return read_metrics(out / "metrics.jsonl")


def _losses(records, kind="train", key="loss"):
    return [r[key] for r in records if r["kind"] == kind]


def test_tp2_gives_tp1_losses_uncompressed_and_saves_the_same_model(tmp_path, data_dir):
    steps = ["--method", "none", "--steps", "4", "--eval-every", "4"]
    plain = _train(data_dir, tmp_path / "dp", *steps, "--dp", "2")
    tp = _train(data_dir, tmp_path / "tp", *steps, "--tp", "2", "--dp", "2")  # (the vocabulary split)
    seq = _train(data_dir, tmp_path / "sp", *steps, "--tp", "2", "--dp", "2", "--sequence-parallel")
    whole = _train(data_dir, tmp_path / "whole", *steps, "--tp", "2", "--dp", "2", "--no-vocab-parallel")
    for run in (tp, seq, whole):
        assert _losses(run) == pytest.approx(_losses(plain), rel=1e-5)
        assert _losses(run, "val", "val_loss") == pytest.approx(_losses(plain, "val", "val_loss"), rel=1e-5)
    # each block's loss counted once, by one TP rank of its replica
    blocks = load_block_losses(tmp_path / "dp")
    assert blocks is not None and blocks.step == 4
    for run in ("tp", "whole"):
        other = load_block_losses(tmp_path / run)
        assert other is not None and np.array_equal(other.starts, blocks.starts)
        np.testing.assert_allclose(other.losses, blocks.losses, rtol=1e-5)
    # the checkpoint holds the model as one process would (c_attn's rows in GPT-2's order;
    # a row out of place would differ by ~0.1): equal but for the sums' float order, which
    # Adam's normalisation turns into at most ~2e-5 after 4 steps of lr 6e-4
    a = torch.load(tmp_path / "dp" / CHECKPOINT_NAME, weights_only=False)["model"]
    for run in ("tp", "whole"):
        b = torch.load(tmp_path / run / CHECKPOINT_NAME, weights_only=False)["model"]
        assert a.keys() == b.keys()
        for name in a:
            assert torch.allclose(a[name], b[name], rtol=0, atol=1e-4), (run, name)
    summary = (tmp_path / "tp" / "summary.md").read_text()
    assert "4 workers as 2 replicas x 1 shard x 2 TP ranks (vocabulary split)" in summary
    assert "4 workers as 2 replicas x 1 shard x 2 TP ranks (vocabulary split, sequence parallel)" in \
        (tmp_path / "sp" / "summary.md").read_text()


def test_tp_compresses_and_resumes_exactly(tmp_path, data_dir):
    common = ["--method", "edgc", "--steps", "12", "--eval-every", "4", "--checkpoint-every", "6",
              "--tp", "2", "--dp", "2", "--edgc-warmup-steps", "3", "--edgc-window", "2",
              "--edgc-iteration-sample-rate", "1.0", "--edgc-max-rank", "8", "--edgc-min-rank", "2",
              "--edgc-noise-exponent", "0.5", "--edgc-warmup", "fixed"]
    straight = _train(data_dir, tmp_path / "straight", *common)
    train = [r for r in straight if r["kind"] == "train"]
    assert [r["rank"] for r in train[:3]] == [0, 0, 0] and all(r["rank"] > 0 for r in train[3:])
    assert len({r["rank"] for r in train[3:]}) >= 2, "the rank should move during this run"
    assert all(r["bytes_sent"] < r["bytes_uncompressed"] for r in train[3:])
    assert all(math.isfinite(r["loss"]) for r in train)
    part = tmp_path / "part"
    _train(data_dir, part, *common, "--stop-after", "7")
    assert main(["train", "--resume", str(part), "--stop-after", "12", "--no-progress"]) == 0
    key = ("step", "loss", "val_loss", "rank", "bytes_sent")
    a = [tuple(r.get(k) for k in key) for r in straight]
    b = [tuple(r.get(k) for k in key) for r in read_metrics(part / "metrics.jsonl")]
    assert a == b
    ca = torch.load(tmp_path / "straight" / CHECKPOINT_NAME, weights_only=False)
    cb = torch.load(part / CHECKPOINT_NAME, weights_only=False)
    assert ca["hsdp"] == [2, 1, 2]
    for k, v in ca["model"].items():
        assert torch.equal(v, cb["model"][k]), k


def test_pp2_tp2_dp2_gives_the_pipelines_losses_then_compresses_and_resumes_exactly(tmp_path, data_dir):
    """8 workers: 2 stages x 2 replicas x 2 TP ranks, the DAC giving each stage one rank
    agreed across its replicas and TP ranks; under torchrun and edgc train's launcher."""
    small = ["--steps", "3", "--eval-every", "3"]
    plain = _train(data_dir, tmp_path / "pp", "--method", "none", "--pp", "2", "--dp", "2", *small)
    tp = _train(data_dir, tmp_path / "pptp", "--method", "none", "--pp", "2", "--tp", "2", "--dp", "2",
                "--no-vocab-parallel", *small)
    assert _losses(tp) == pytest.approx(_losses(plain), rel=1e-5)
    assert _losses(tp, "val", "val_loss") == pytest.approx(_losses(plain, "val", "val_loss"), rel=1e-5)
    # each block's loss counted once, by the last stage's first TP rank of its replica
    a, b = load_block_losses(tmp_path / "pp"), load_block_losses(tmp_path / "pptp")
    assert a is not None and b is not None and np.array_equal(a.starts, b.starts)
    np.testing.assert_allclose(b.losses, a.losses, rtol=1e-5)
    assert float(a.losses.mean()) == pytest.approx(_losses(plain, "val", "val_loss")[-1], rel=1e-9)

    # (the embedding and the head's copy split on the vocabulary here, the default; whole in the run above)
    common = ["--method", "edgc", "--steps", "8", "--eval-every", "4", "--checkpoint-every", "4", "--pp", "2",
              "--tp", "2", "--dp", "2", "--edgc-warmup-steps", "3", "--edgc-window", "2",
              "--edgc-iteration-sample-rate", "1.0", "--edgc-max-rank", "8", "--edgc-min-rank", "2",
              "--edgc-noise-exponent", "0.5",
              # given timings (T = 1 ms per rank): deterministic DAC decisions, so a resume is exact
              "--dac-eta", "0.001", "--dac-t-mb", "0.004", "--dac-t-uncompressed", "1.0"]
    # the uninterrupted run under torchrun (8 workers on one node), the interrupted one with
    # edgc train's own launcher
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "8", "--master-port", str(free_port()),
           "-m", "edgc", "train", "--data", str(data_dir), "--out", str(tmp_path / "straight"), *COMMON, *common]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    straight = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    summary = (tmp_path / "straight" / "summary.md").read_text()
    assert "8 workers as 2 pipeline stages x 2 replicas x 2 TP ranks" in summary
    train = [r for r in straight if r["kind"] == "train"]
    assert all(r["phase"] == "compress" and r["bytes_sent"] < r["bytes_uncompressed"] for r in train[3:])
    assert all(min(r["stage_rank"]) > 0 for r in train[3:]), [r["stage_rank"] for r in train]
    part = tmp_path / "part"
    _train(data_dir, part, *common, "--stop-after", "5")
    assert main(["train", "--resume", str(part), "--stop-after", "8", "--no-progress"]) == 0
    key = ("step", "loss", "val_loss", "rank", "stage_rank", "bytes_sent")
    a = [tuple(str(r.get(k)) for k in key) for r in straight]
    b = [tuple(str(r.get(k)) for k in key) for r in read_metrics(part / "metrics.jsonl")]
    assert a == b
    ckpt = torch.load(tmp_path / "straight" / CHECKPOINT_NAME, weights_only=False)
    assert ckpt["layout"] == [2, 2, 2]
    # one rank per stage on every replica and TP rank (global rank = (stage * 2 + replica) * 2 + tp)
    ranks = [r["comm"]["applied_rank"] for r in ckpt["replicas"]]
    assert ranks[:4] == [ranks[0]] * 4 and ranks[4:] == [ranks[4]] * 4 and ranks[0] > 0, ranks
    resumed = torch.load(part / CHECKPOINT_NAME, weights_only=False)
    for p, stage in enumerate(ckpt["stages"]):
        for k, v in stage["model"].items():
            assert torch.equal(v, resumed["stages"][p]["model"][k]), (p, k)


def test_the_simulator_counts_the_bytes_the_library_sends_per_tp_shard(tmp_path, data_dir):
    """`edgc simulate`'s layout of a TP shard (edgc.bench.simulate.stage_gradients) is what
    `edgc train --tp` syncs: every step's bytes, per replica (its TP ranks together) and
    per stage, equal the simulator's count (static rank 4, the gradient's dtype on the
    wire: 4 bytes an element), with the vocabulary split (the default) and without."""
    args = ["--method", "powersgd", "--steps", "4", "--edgc-warmup-steps", "2", "--edgc-warmup", "fixed",
            "--edgc-wire", "native"]
    model = build_model("tiny", vocab_size=512, block_size=32, device="meta")
    opts = SimOptions(rank_max=4, min_compression_rate=EDGCConfig().min_compression_rate)

    def counted(stage, compressed):
        if not compressed:
            return 2 * 4 * stage.numel  # (2 TP ranks, 4 bytes an element)
        mats, rest = compressed_matrices(stage, opts)
        return 2 * 4 * (rest + sum(c * (m + n) * min(4, m, n) for (m, n), c in mats.items()))

    train = [r for r in _train(data_dir, tmp_path / "tp", "--tp", "2", "--dp", "2", *args) if r["kind"] == "train"]
    [stage] = stage_gradients(model, tp=2, pp=1)  # (layout "vocab")
    assert [r["bytes_sent"] for r in train] == [counted(stage, r["phase"] == "compress") for r in train]
    assert [r["phase"] for r in train] == ["warmup", "warmup", "compress", "compress"]

    train = [r for r in _train(data_dir, tmp_path / "pptp", "--pp", "2", "--tp", "2", "--dp", "2",
                               "--dac-stage-ranks", "uniform", "--no-vocab-parallel", *args) if r["kind"] == "train"]
    stages = stage_gradients(model, tp=2, pp=2, layout="whole")
    assert [r["stage_bytes_sent"] for r in train] == [[counted(s, r["phase"] == "compress") for s in stages]
                                                      for r in train]
