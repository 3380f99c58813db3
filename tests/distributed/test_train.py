"""`edgc train` / `edgc report` end to end with 2 local gloo workers on a small corpus."""

import json
import math

import pytest
import torch

from edgc.cli import main
from edgc.data import prepare_builtin, write_meta
from edgc.train.blocks import block_losses_by_step
from edgc.train.checkpoint import CHECKPOINT_NAME
from edgc.train.metrics import read_metrics

TRAIN_KEYS = {"step", "loss", "lr", "tokens_per_s", "step_time", "comm_time", "bytes_sent",
              "bytes_uncompressed", "rank", "entropy", "phase"}


def _args(data_dir, out, *extra):
    return ["train", "--data", str(data_dir), "--out", str(out), "--batch-size", "4", "--block-size", "32",
            "--eval-tokens", "256", "--no-progress", "--rank", "4", *extra]


@pytest.mark.parametrize("method", ["none", "powersgd", "torch-powersgd",
                                    pytest.param("edgc", marks=pytest.mark.smoke)])
def test_train_each_method_writes_every_output(tmp_path, data_dir, method):
    out = tmp_path / method
    assert main(_args(data_dir, out, "--method", method, "--steps", "8", "--eval-every", "4",
                      "--edgc-warmup-steps", "2", "--edgc-window", "2")) == 0
    for name in ("config.json", "metrics.jsonl", CHECKPOINT_NAME, "summary.md",
                 "loss.png", "entropy.png", "rank.png", "bytes.png"):
        assert (out / name).is_file(), name
    records = read_metrics(out / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "val"]
    assert [r["step"] for r in train] == list(range(1, 9))
    assert TRAIN_KEYS <= set(train[0])
    assert [r["step"] for r in val] == [4, 8] and math.isfinite(val[-1]["val_loss"])
    # the same 8 blocks of 32 tokens (--eval-tokens 256) at each evaluation, with a standard error
    assert all(r["val_tokens"] == 256 and 0 < r["val_loss_se"] < r["val_loss"] for r in val)
    # every evaluation's 8 block losses are kept, and their mean is the loss logged
    blocks = block_losses_by_step(out)
    assert sorted(blocks) == [4, 8]
    for r in val:
        assert blocks[r["step"]].losses.shape == (8,)
        assert math.isclose(blocks[r["step"]].losses.mean(), r["val_loss"], rel_tol=1e-9)
    summary = (out / "summary.md").read_text()
    assert f"{val[-1]['val_loss']:.4f} ± {val[-1]['val_loss_se']:.4f}" in summary
    assert "standard error" in summary and "8 blocks of 32 tokens" in summary
    assert all(math.isfinite(r["loss"]) for r in train)
    sent = sum(r["bytes_sent"] for r in train)
    full = sum(r["bytes_uncompressed"] for r in train)
    if method == "none":
        assert sent == full
    else:
        assert 0 < sent < full  # compression started after the 2 warm-up steps
        assert train[-1]["rank"] > 0 and train[-1]["phase"] == "compress"


@pytest.mark.smoke
def test_resume_continues_exactly(tmp_path, data_dir):
    common = ["--method", "edgc", "--steps", "16", "--eval-every", "4", "--checkpoint-every", "8",
              "--edgc-warmup-steps", "3", "--edgc-window", "2", "--edgc-iteration-sample-rate", "1.0",
              "--edgc-max-rank", "8", "--edgc-min-rank", "2", "--edgc-noise-exponent", "0.5"]
    straight = tmp_path / "straight"
    assert main(_args(data_dir, straight, *common)) == 0
    # Stop after 7 steps (mid-window, after a checkpoint-free stretch), then resume to 16.
    part = tmp_path / "part"
    assert main(_args(data_dir, part, *common, "--stop-after", "7")) == 0
    assert max(r["step"] for r in read_metrics(part / "metrics.jsonl")) == 7
    assert main(["train", "--resume", str(part), "--stop-after", "16", "--no-progress"]) == 0
    a = [(r["step"], r.get("loss"), r.get("val_loss"), r.get("rank")) for r in read_metrics(straight / "metrics.jsonl")]
    b = [(r["step"], r.get("loss"), r.get("val_loss"), r.get("rank")) for r in read_metrics(part / "metrics.jsonl")]
    assert a == b
    assert len({r[3] for r in a if r[3]}) >= 2, "the rank should move during this run"
    blocks_a, blocks_b = block_losses_by_step(straight), block_losses_by_step(part)
    assert sorted(blocks_a) == sorted(blocks_b) == [4, 8, 12, 16]
    for step, kept in blocks_a.items():
        assert (kept.losses == blocks_b[step].losses).all(), step
    ca = torch.load(straight / CHECKPOINT_NAME, weights_only=False)
    cb = torch.load(part / CHECKPOINT_NAME, weights_only=False)
    for k, v in ca["model"].items():
        assert torch.equal(v, cb["model"][k]), k


def test_errors_are_clear(tmp_path, data_dir, capsys):
    assert main(_args(data_dir, tmp_path / "x", "--method", "fast")) == 2
    assert "method='fast'" in capsys.readouterr().err
    assert main(_args(tmp_path / "nowhere", tmp_path / "y")) == 2
    assert "edgc prepare" in capsys.readouterr().err
    assert main(_args(data_dir, tmp_path / "z", "--edgc-window", "0")) == 2
    assert "EDGCConfig.window" in capsys.readouterr().err

    run = tmp_path / "run"
    assert main(_args(data_dir, run, "--steps", "2", "--method", "none")) == 0
    assert main(_args(data_dir, run, "--steps", "2", "--method", "none")) == 2  # would overwrite
    assert "already holds a run" in capsys.readouterr().err
    torch_run = tmp_path / "torch-run"  # (another number of replicas: every method but torch's hook)
    assert main(_args(data_dir, torch_run, "--steps", "2", "--method", "torch-powersgd")) == 0
    assert main(["train", "--resume", str(torch_run), "--steps", "4", "--nproc", "1", "--no-progress"]) == 2
    assert "torch keeps its error feedback per DDP bucket" in capsys.readouterr().err
    assert main(["train", "--resume", str(run), "--steps", "4", "--method", "edgc", "--no-progress"]) == 2
    assert "method" in capsys.readouterr().err
    (run / CHECKPOINT_NAME).write_bytes((run / CHECKPOINT_NAME).read_bytes()[:1000])
    assert main(["train", "--resume", str(run), "--steps", "4", "--no-progress"]) == 2
    assert "corrupt or truncated" in capsys.readouterr().err


def test_report_compares_runs(tmp_path, data_dir):
    for method in ("none", "edgc"):
        assert main(_args(data_dir, tmp_path / method, "--method", method, "--steps", "4",
                          "--edgc-warmup-steps", "1")) == 0
    assert main(["report", str(tmp_path / "none"), str(tmp_path / "edgc"), "--out", str(tmp_path / "rep")]) == 0
    text = (tmp_path / "rep" / "report.md").read_text()
    assert "| none | none |" in text and "| edgc | edgc |" in text
    # rank 0's memory record: the EDGC state (0 without it), in report.md and each summary.md
    memory = {m: next(json.loads(line) for line in (tmp_path / m / "metrics.jsonl").read_text().splitlines()
                      if json.loads(line).get("kind") == "memory") for m in ("none", "edgc")}
    assert memory["none"]["compression_mb"] == 0 < memory["edgc"]["compression_mb"]
    for m in ("none", "edgc"):
        row = f"| {m} | {memory[m]['compression_mb']:.2f} | {memory[m]['state_mb']:.1f} |"
        assert row in text and row in (tmp_path / m / "summary.md").read_text()
    for name in ("loss.png", "entropy.png", "rank.png", "bytes.png"):
        assert (tmp_path / "rep" / name).is_file()
    assert main(["report", str(tmp_path / "missing")]) == 2


def test_config_file_sets_fields(tmp_path, data_dir):
    cfg = tmp_path / "run.toml"
    cfg.write_text('method = "powersgd"\nsteps = 3\n[edgc]\nwarmup_steps = 1\nmax_rank = 2\n')
    out = tmp_path / "cfgrun"
    assert main(_args(data_dir, out, "--config", str(cfg))) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["method"] == "powersgd" and saved["steps"] == 3
    assert saved["edgc"]["max_rank"] == 2 and saved["edgc"]["policy"] == "static"


def test_under_torchrun(tmp_path, data_dir):
    import subprocess
    import sys

    from edgc.train.launch import free_port

    out = tmp_path / "torchrun"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "edgc", *_args(data_dir, out, "--method", "edgc", "--steps", "4", "--edgc-warmup-steps", "1")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = json.loads((out / "config.json").read_text())
    assert saved["world_size"] == 2
    train = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4] and train[-1]["phase"] == "compress"
    assert (out / "summary.md").is_file()


@pytest.mark.parametrize("extra", [["--edgc-wire", "fp8", "--edgc-state-dtype", "bf16"]])
def test_quantized_modes_train_and_resume_exactly(tmp_path, data_dir, extra):
    # (int8, the default wire, is what test_resume_continues_exactly resumes)
    common = ["--method", "edgc", "--steps", "12", "--eval-every", "6", "--checkpoint-every", "6",
              "--edgc-warmup", "fixed", "--edgc-warmup-steps", "3", "--edgc-window", "2", *extra]
    straight, part, full = tmp_path / "straight", tmp_path / "part", tmp_path / "full"
    assert main(_args(data_dir, straight, *common)) == 0
    assert main(_args(data_dir, part, *common, "--stop-after", "7")) == 0
    assert main(["train", "--resume", str(part), "--stop-after", "12", "--no-progress"]) == 0
    a = [(r["step"], r.get("loss"), r.get("val_loss"), r.get("rank")) for r in read_metrics(straight / "metrics.jsonl")]
    b = [(r["step"], r.get("loss"), r.get("val_loss"), r.get("rank")) for r in read_metrics(part / "metrics.jsonl")]
    assert a == b
    config = json.loads((straight / "config.json").read_text())
    assert json.dumps(config).count('"wire": "' + extra[1] + '"') == 1
    # the same run with the factors in float32, both at once: its compressed steps send more
    assert main(_args(data_dir, full, *common[:-len(extra)], "--edgc-wire", "native")) == 0
    sent = [sum(r["bytes_sent"] for r in read_metrics(d / "metrics.jsonl") if r["kind"] == "train" and r["rank"])
            for d in (straight, full)]
    assert sent[0] < 0.7 * sent[1]


def test_the_token_embedding_compresses_at_twice_the_rank_of_the_rest(tmp_path):
    # a 1024-token vocabulary: the token embedding (1024 x 128) is 8 times as long as wide
    # (5 or more is long; with the 512 tokens of the other tests' corpus it is 4).
    # Static rank 4 with float32 factors, so that the bytes are exact: the embedding at rank
    # 8 by default, at 4 with --edgc-long-rank-factor 1
    data_dir = tmp_path / "data"
    prepared = prepare_builtin(data_dir, tokenizer="bpe", max_bytes=200_000, vocab_size=1024)
    write_meta(data_dir, prepared.tokenizer, 1024, prepared.train_tokens, prepared.val_tokens, source="test")
    common = ["--method", "edgc", "--steps", "5", "--eval-every", "5", "--edgc-policy", "static",
              "--edgc-warmup", "fixed", "--edgc-warmup-steps", "2", "--edgc-wire", "native"]
    runs = {factor: tmp_path / f"factor-{factor}" for factor in ("1", "default")}
    assert main(_args(data_dir, runs["1"], *common, "--edgc-long-rank-factor", "1")) == 0
    assert main(_args(data_dir, runs["default"], *common)) == 0
    checkpoint = torch.load(runs["default"] / CHECKPOINT_NAME, weights_only=False)
    vocab, width = checkpoint["model"]["wte.weight"].shape
    assert vocab == 8 * width and checkpoint["train"]["edgc"]["long_rank_factor"] == 2.0
    sent = {f: [r["bytes_sent"] for r in read_metrics(d / "metrics.jsonl") if r["kind"] == "train" and r["rank"]]
            for f, d in runs.items()}
    assert len(sent["1"]) == len(sent["default"]) == 3  # (steps 3 to 5 compress)
    # each compressed step sends 4 more columns of P (vocab) and Q (width), 4 bytes a number
    assert [b - a for a, b in zip(sent["1"], sent["default"], strict=True)] == [(vocab + width) * 4 * 4] * 3
