"""`edgc train --method diloco` and `--method edgc-diloco` end to end with 2 local gloo
workers: bytes, replicas identical at every outer step, an exact resume mid-phase, and the
refusals."""

import pytest
import torch

from edgc.cli import main
from edgc.train.checkpoint import CHECKPOINT_NAME
from edgc.train.metrics import read_metrics

pytestmark = pytest.mark.slow


def _args(data_dir, out, *extra):
    return ["train", "--data", str(data_dir), "--out", str(out), "--batch-size", "4", "--block-size", "32",
            "--eval-tokens", "256", "--no-progress", "--rank", "4", "--steps", "16", "--eval-every", "8",
            "--diloco-inner-steps", "4", *extra]


#: edgc-diloco's core over 4 outer steps: a fixed warm-up of 1, windows of 2
EDGC = ["--edgc-warmup", "fixed", "--edgc-warmup-steps", "1", "--edgc-window", "2", "--edgc-min-compression-rate", "1"]


@pytest.mark.parametrize("method, wire", [("diloco", None), ("edgc-diloco", None), ("edgc-diloco", "int4")])
def test_a_diloco_run_syncs_every_h_steps_resumes_exactly_and_keeps_replicas_identical(tmp_path, data_dir, method,
                                                                                       wire):
    extra = ["--method", method, "--checkpoint-every", "4", *(EDGC if method == "edgc-diloco" else []),
             *(["--edgc-wire", wire] if wire else [])]
    straight = tmp_path / "straight"
    assert main(_args(data_dir, straight, *extra)) == 0
    train = [r for r in read_metrics(straight / "metrics.jsonl") if r["kind"] == "train"]
    synced = [r["step"] for r in train if r["bytes_sent"] > 0]
    assert synced == [4, 8, 12, 16]  # (one sync every H = 4 steps, none between)
    assert all(r["comm_time"] > 0 for r in train if r["step"] in synced)  # (the outer syncs are timed)
    whole = train[0]["bytes_uncompressed"]  # (DDP's all-reduce of one step, which each step counts)
    assert all(r["bytes_uncompressed"] == whole for r in train)
    sent = sum(r["bytes_sent"] for r in train)
    if method == "diloco":
        assert sent == 4 * whole  # (1/H of DDP's bytes, in float32 as DDP's)
    else:  # (int4: every sync at most 1/2 + 2/32 bytes an element, 0.14x float32's)
        assert 0 < sent < 4 * whole * (0.15 if wire == "int4" else 0.5) and train[-1]["rank"] > 0
    # the checkpoint (step 16, an outer step) holds every replica's DiLoCo state: the same θ,
    # and on the int4 wire each replica's own error feedback of the whole pseudo-gradient
    ckpt = torch.load(straight / CHECKPOINT_NAME, weights_only=False)
    states = [r["comm"]["diloco"] for r in ckpt["replicas"]]
    assert [s.get("error") is not None for s in states] == [wire == "int4"] * 2
    for a, b in zip(states[0]["global"], states[1]["global"], strict=True):
        assert torch.equal(a, b)
    # stopped after 6 steps (2 into the second inner phase), resumed: bit for bit the same
    part = tmp_path / "part"
    assert main(_args(data_dir, part, *extra, "--stop-after", "6")) == 0
    assert main(["train", "--resume", str(part), "--stop-after", "16", "--no-progress"]) == 0
    keys = ("step", "loss", "val_loss", "bytes_sent", "rank")
    a = [tuple(r.get(k) for k in keys) for r in read_metrics(straight / "metrics.jsonl") if r["kind"] != "memory"]
    b = [tuple(r.get(k) for k in keys) for r in read_metrics(part / "metrics.jsonl") if r["kind"] != "memory"]
    assert a == b
    resumed = torch.load(part / CHECKPOINT_NAME, weights_only=False)
    for x, y in zip(ckpt["model"].values(), resumed["model"].values(), strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("flags, words", [
    (["--method", "diloco", "--diloco-inner-steps", "0"], "diloco_inner_steps"),
    (["--method", "diloco", "--diloco-outer-lr", "0"], "diloco_outer_lr"),
    (["--method", "diloco", "--diloco-outer-momentum", "1"], "diloco_outer_momentum"),
    (["--method", "diloco", "--dp-shard", "2", "--dp-replicate", "1"], "not built for DiLoCo"),
    (["--method", "edgc-diloco", "--tp", "2"], "not built for DiLoCo"),
    (["--method", "diloco", "--pp", "2"], "not built for DiLoCo"),
])
def test_bad_settings_are_refused_in_one_line(tmp_path, data_dir, capsys, flags, words):
    assert main(_args(data_dir, tmp_path / "bad", *flags)) != 0
    err = capsys.readouterr().err
    assert words in err, err


def test_a_run_resumes_only_as_the_method_it_ran(tmp_path, data_dir, capsys):
    run = tmp_path / "run"
    assert main(_args(data_dir, run, "--method", "diloco", "--stop-after", "4")) == 0
    assert main(["train", "--resume", str(run), "--method", "edgc", "--no-progress"]) != 0
    assert "method" in capsys.readouterr().err
    edgc_run = tmp_path / "edgc-run"
    assert main(_args(data_dir, edgc_run, "--method", "edgc", "--stop-after", "4")) == 0
    assert main(["train", "--resume", str(edgc_run), "--method", "diloco", "--no-progress"]) != 0
    assert "method" in capsys.readouterr().err
