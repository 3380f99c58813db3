"""Commands as the README writes them, run as a user runs them: `edgc prepare` on a folder,
`edgc train` on that folder from another directory, precision and device flags, and the
metrics a run writes."""

import json
import math
import os

import pytest

from edgc.cli import main
from edgc.data import data_tokenizer
from edgc.train.checkpoint import CHECKPOINT_NAME
from edgc.train.metrics import read_metrics
from harness import run_edgc as _edgc
from harness import train_args as _train

TEXT = """The quick brown fox jumps over the lazy dog. {i} Pack my box with five dozen liquor jugs.
How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow. {i}
"""


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    root = tmp_path_factory.mktemp("texts")
    (root / "notes").mkdir()
    for i in range(12):
        (root / ("notes" if i % 2 else ".") / f"doc{i}.txt").write_text(TEXT.format(i=i) * 40)
    (root / ".hidden.txt").write_text("not this")
    return root


@pytest.mark.parametrize("tokenizer", ["gpt2", "bpe"])
def test_prepare_a_folder_then_train_from_another_directory(tmp_path, texts, tokenizer):
    work = tmp_path / "work"
    work.mkdir()
    os.symlink(texts, work / "texts")
    proc = _edgc("prepare", "texts/", "--out", "data/mine", "--tokenizer", tokenizer, "--vocab-size", "300", cwd=work)
    assert proc.returncode == 0, proc.stderr
    assert "train /" in proc.stdout and "validation tokens" in proc.stdout
    meta = json.loads((work / "data/mine/meta.json").read_text())
    assert meta["train_files"] + meta["val_files"] == 12
    if tokenizer == "bpe":
        assert meta["tokenizer"] == "tokenizer.json"  # inside the folder, relative to it
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert data_tokenizer(work / "data/mine").vocab_size == meta["vocab_size"]
    # a second prepare reuses the saved tokenizer file, from a list of files
    if tokenizer == "bpe":
        proc = _edgc("prepare", "texts/doc0.txt", "texts/notes", "--out", str(tmp_path / "again"),
                     "--tokenizer", "data/mine/tokenizer.json", cwd=work)
        assert proc.returncode == 0, proc.stderr
        assert json.loads((tmp_path / "again/meta.json").read_text())["vocab_size"] == meta["vocab_size"]
    proc = _edgc("train", "--data", str(work / "data/mine"), "--out", "run", "--steps", "3", "--batch-size", "2",
                 "--block-size", "16", "--eval-tokens", "256", "--no-progress", "--method", "none", cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    assert (elsewhere / "run" / "summary.md").is_file()


def test_prepare_errors_are_clear(tmp_path, texts):
    proc = _edgc("prepare", str(tmp_path / "missing"), "--out", str(tmp_path / "d"), cwd=tmp_path)
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr
    proc = _edgc("prepare", str(texts / "doc0.txt"), "--out", str(tmp_path / "d"), cwd=tmp_path)
    assert proc.returncode == 2 and "at least two files" in proc.stderr
    proc = _edgc("prepare", str(texts), "--out", str(tmp_path / "d"), "--tokenizer", "nope.json", cwd=tmp_path)
    assert proc.returncode == 2 and "nope.json" in proc.stderr


def _train_records(run):
    """The "train" records of a run folder's metrics.jsonl, in order."""
    return [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"]


def _straight_and_resumed(data_dir, tmp_path, common, stop, steps):
    """One run straight through and one stopped at `stop` then resumed to `steps`; returns
    each run's (step, loss, val_loss, rank) records, and the straight run's folder."""
    straight = tmp_path / "straight"
    assert main(_train(data_dir, straight, *common)) == 0
    part = tmp_path / "part"
    assert main(_train(data_dir, part, *common, "--stop-after", str(stop))) == 0
    assert main(["train", "--resume", str(part), "--stop-after", str(steps), "--no-progress"]) == 0
    a, b = ([(r["step"], r.get("loss"), r.get("val_loss"), r.get("rank")) for r in read_metrics(d / "metrics.jsonl")]
            for d in (straight, part))
    return a, b, straight


def test_metrics_show_what_each_step_did(tmp_path, data_dir):
    out = tmp_path / "run"
    assert main(_train(data_dir, out, "--method", "edgc", "--steps", "6", "--edgc-warmup-steps", "2",
                       "--edgc-warmup", "fixed", "--edgc-window", "2")) == 0
    train = _train_records(out)
    # steps 1-2 are the (fixed) warm-up: sent whole, at rank 0, in the default int8 wire
    # format (a byte an element and a 2-byte scale a block of 32, plus the control vector)
    for r in train[:2]:
        assert (r["phase"], r["rank"]) == ("warmup", 0), r
        assert 0.25 * r["bytes_uncompressed"] < r["bytes_sent"] < 0.3 * r["bytes_uncompressed"]
    for r in train[2:]:
        assert r["phase"] == "compress" and 0 < r["rank"] <= 4, r  # (the noise policy may lower it)
        assert r["bytes_sent"] < r["bytes_uncompressed"] / 2
    # the default policy decides from the noise scale, and measures the entropy for the plots
    assert all(isinstance(r["entropy"], float) and math.isfinite(r["entropy"]) for r in train), train


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_precision_trains_and_resumes_exactly(tmp_path, data_dir, dtype):
    common = ["--method", "edgc", "--steps", "8", "--eval-every", "4", "--checkpoint-every", "4",
              "--edgc-warmup-steps", "2", "--edgc-window", "2", "--dtype", dtype, "--device", "cpu"]
    a, b, straight = _straight_and_resumed(data_dir, tmp_path, common, 4, 8)
    assert a == b
    assert all(math.isfinite(r[1]) for r in a if r[1] is not None)
    saved = json.loads((straight / "config.json").read_text())
    assert (saved["dtype"], saved["device"]) == (dtype, "cpu")
    import torch

    ckpt = torch.load(straight / CHECKPOINT_NAME, weights_only=False)
    if dtype == "fp16":
        assert ckpt["scaler"]["scale"] > 0  # the GradScaler's state resumes with the run
        assert ckpt["replicas"][0]["comm"]["stats"]["grad_scale"] == ckpt["scaler"]["scale"]


def test_device_and_dtype_errors(tmp_path, data_dir, capsys):
    import torch

    if not torch.cuda.is_available():
        assert main(_train(data_dir, tmp_path / "a", "--device", "cuda")) == 2
        assert "no CUDA device" in capsys.readouterr().err
    assert main(_train(data_dir, tmp_path / "b", "--dtype", "fp8")) == 2
    assert "dtype" in capsys.readouterr().err
    assert main(_train(data_dir, tmp_path / "c", "--device", "tpu")) == 2
    assert "device" in capsys.readouterr().err


def test_pipeline_refuses_what_it_does_not_support_yet(tmp_path, data_dir, capsys):
    assert main(_train(data_dir, tmp_path / "a", "--pp", "2", "--edgc-policy", "schedule",
                       "--edgc-schedule-ranks", "0:4")) == 2
    assert "policy='schedule': does not take the DAC's stage alignment yet" in capsys.readouterr().err
    assert main(_train(data_dir, tmp_path / "b", "--pp", "2", "--dtype", "bf16")) == 2
    assert "mixed precision is not supported with pp > 1" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # refused before writing anything


def test_rank_schedule_through_the_cli_changes_rank_at_its_knots_and_resumes_exactly(tmp_path, data_dir):
    common = ["--method", "edgc", "--rank", "8", "--steps", "10", "--eval-every", "5", "--checkpoint-every", "5",
              "--edgc-policy", "schedule", "--edgc-schedule-ranks", "0:8,6:4", "--edgc-warmup-steps", "2"]
    a, b, straight = _straight_and_resumed(data_dir, tmp_path, common, 5, 10)
    train = _train_records(straight)
    assert [r["rank"] for r in train] == [0, 0, 8, 8, 8, 4, 4, 4, 4, 4]
    assert a == b


def test_policy_option_errors_name_the_field(tmp_path, data_dir, capsys):
    assert main(_train(data_dir, tmp_path / "a", "--method", "edgc", "--rank", "8", "--edgc-policy", "schedule",
                       "--edgc-schedule-ranks", "0:8,5:16")) == 2
    assert "schedule.ranks" in capsys.readouterr().err and not (tmp_path / "a").exists()
    assert main(_train(data_dir, tmp_path / "b", "--method", "edgc", "--rank", "8", "--edgc-policy", "schedule",
                       "--edgc-schedule-ranks", "5:8,2:4")) == 2
    assert "must increase" in capsys.readouterr().err
    assert main(_train(data_dir, tmp_path / "c", "--method", "edgc", "--edgc-policy", "critical",
                       "--edgc-critical-lr-drop-factor", "1.5")) == 2
    assert "EDGCConfig.critical.lr_drop_factor=1.5: must be in (0, 1)" in capsys.readouterr().err
    assert main(_train(data_dir, tmp_path / "d", "--method", "edgc", "--edgc-policy", "spectral")) == 2
    assert "policy='spectral': removed in edgc 0.2.0" in capsys.readouterr().err


def test_torch_powersgd_resumes_exactly(tmp_path, data_dir):
    # stopped after its first compressed step: the checkpoint holds torch's error feedback
    # and warm-start Q, saved in DDP's rebuilt buckets, and the resumed job's first step
    # runs in DDP's initial ones
    common = ["--method", "torch-powersgd", "--steps", "6", "--eval-every", "3", "--checkpoint-every", "3",
              "--edgc-warmup-steps", "1"]
    a, b, straight = _straight_and_resumed(data_dir, tmp_path, common, 3, 6)
    train = _train_records(straight)
    assert [r["rank"] for r in train] == [0, 0, 4, 4, 4, 4]
    assert a == b


@pytest.mark.parametrize("pp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_emulated_device_time_changes_the_clock_and_not_the_maths(tmp_path, data_dir, pp):
    common = ["--method", "edgc", "--steps", "4", "--eval-every", "4", "--edgc-warmup-steps", "1",
              "--edgc-window", "2", "--pp", str(pp), "--device", "cpu"]
    plain, slow = tmp_path / "plain", tmp_path / "slow"
    assert main(_train(data_dir, plain, *common)) == 0
    proc = _edgc(*_train(data_dir, slow, *common, "--emulated-device-ms", "50"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    a, b = ([{k: r.get(k) for k in ("kind", "step", "loss", "val_loss", "rank", "bytes_sent")}
             for r in read_metrics(d / "metrics.jsonl")] for d in (plain, slow))
    assert a == b  # the same run, bit for bit
    # each of rank 0's blocks waited 50 ms forward and 100 ms backward per micro-batch: the
    # 4 blocks of tiny, or 2 per stage with 2 * pp micro-batches (plain steps take ~0.2 s)
    waited = 4 * 0.15 if pp == 1 else 2 * 0.15 * 2 * pp
    assert json.loads((slow / "config.json").read_text())["emulated_device_ms"] == 50
    for r in read_metrics(slow / "metrics.jsonl"):
        if r["kind"] == "train":
            assert r["step_time"] >= waited, r


def test_min_unit_mb_reaches_the_state_may_change_on_resume_and_a_bad_value_ends_in_one_line(tmp_path, data_dir):
    import torch

    run = tmp_path / "run"
    # small buckets, so that the plan has several and the threshold merges some
    proc = _edgc(*_train(data_dir, run, "--method", "edgc", "--steps", "4", "--stop-after", "2",
                         "--bucket-cap-mb", "0.1", "--edgc-warmup-steps", "1", "--edgc-min-unit-mb", "0.05"),
                 cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    ckpt = torch.load(run / CHECKPOINT_NAME, weights_only=False)
    assert [r["comm"]["config"]["min_unit_mb"] for r in ckpt["replicas"]] == [0.05, 0.05]
    assert len(ckpt["replicas"][0]["comm"]["compression"]["units"]) > 1
    proc = _edgc("train", "--resume", str(run), "--stop-after", "null", "--edgc-min-unit-mb", "0.2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    ckpt = torch.load(run / CHECKPOINT_NAME, weights_only=False)
    assert ckpt["step"] == 4 and [r["comm"]["config"]["min_unit_mb"] for r in ckpt["replicas"]] == [0.2, 0.2]
    # (nan and inf: test_bad_input, for every float flag)
    proc = _edgc(*_train(data_dir, tmp_path / "bad", "--edgc-min-unit-mb", "-1"), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "edgc train: error: EDGCConfig.min_unit_mb=-1.0: must be a non-negative number (MB)"]
    assert not (tmp_path / "bad").exists()


def test_the_round_s_options_reach_the_state_and_max_units_may_change_on_resume(tmp_path, data_dir):
    import torch

    run = tmp_path / "run"
    # small buckets, so that the plan has several for max_units to merge
    proc = _edgc(*_train(data_dir, run, "--method", "edgc", "--steps", "4", "--stop-after", "2",
                         "--bucket-cap-mb", "0.1", "--edgc-warmup-steps", "1", "--edgc-max-units", "2",
                         "--edgc-orthogonalization", "householder"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    ckpt = torch.load(run / CHECKPOINT_NAME, weights_only=False)
    configs = [r["comm"]["config"] for r in ckpt["replicas"]]
    assert [(c["max_units"], c["orthogonalization"]) for c in configs] == [(2, "householder")] * 2
    assert len(ckpt["replicas"][0]["comm"]["compression"]["units"]) > 2  # (the plan kept is DDP's buckets)
    proc = _edgc("train", "--resume", str(run), "--stop-after", "null", "--edgc-max-units", "0", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    ckpt = torch.load(run / CHECKPOINT_NAME, weights_only=False)
    assert ckpt["step"] == 4 and [r["comm"]["config"]["max_units"] for r in ckpt["replicas"]] == [0, 0]
    # the orthogonalization is the run's: a resume that changes it is refused by name
    proc = _edgc("train", "--resume", str(run), "--steps", "6", "--edgc-orthogonalization", "cholesky", cwd=tmp_path)
    assert proc.returncode == 2 and "--edgc-orthogonalization" in proc.stderr


def test_critical_policy_through_the_cli_raises_the_rank_after_a_step_lr_drop_and_resumes_exactly(tmp_path, data_dir):
    # a threshold rho never reaches: r_max for the first windows (no earlier one to compare
    # with), then r_lo = 4, but for the window after the learning rate drops at step 7
    common = ["--method", "edgc", "--rank", "8", "--steps", "12", "--eval-every", "6", "--checkpoint-every", "6",
              "--edgc-policy", "critical", "--edgc-critical-threshold", "1e6", "--edgc-window", "3",
              "--edgc-warmup-steps", "1", "--lr-schedule", "step", "--lr-drop-steps", "7"]
    a, b, straight = _straight_and_resumed(data_dir, tmp_path, common, 8, 12)  # stopped mid-window
    assert a == b
    signals = [[(r["step"], r["critical_rho"], r["window_norm"], r["lr_drop"], r["noise_scale"])
                for r in _train_records(d)] for d in (straight, tmp_path / "part")]
    assert signals[0] == signals[1]  # the window sums and the rule's state resumed too
    train = _train_records(straight)
    assert [r["rank"] for r in train] == [0, 8, 8, 8, 8, 8, 4, 4, 4, 8, 8, 8]
    assert [r["lr"] for r in train[5:7]] == [1e-3, pytest.approx(1e-4)]
    ends = train[2::3]  # steps 3, 6, 9, 12
    assert [r["lr_drop"] for r in ends] == [False, False, True, False]
    assert ends[0]["critical_rho"] is None and all(r["critical_rho"] >= 0 for r in ends[1:])
    assert all(r["window_norm"] > 0 for r in ends) and all("noise_scale" in r for r in train)


def test_noise_policy_and_a_warmup_the_gradient_ends_through_the_cli_resume_exactly(tmp_path, data_dir):
    from edgc.policy.noise import next_noise_rank

    # any rank-r_max error passes: the warm-up ends at the first check (step 2, alpha 1/2),
    # long before its cap of 10 steps; windows of 3 steps, gamma 4 so that the rank moves
    common = ["--method", "edgc", "--rank", "8", "--steps", "15", "--eval-every", "5", "--checkpoint-every", "5",
              "--edgc-policy", "noise", "--edgc-noise-exponent", "4", "--edgc-window", "3",
              "--edgc-iteration-sample-rate", "0.5", "--edgc-warmup-steps", "10", "--edgc-warmup-max-error", "1",
              "--edgc-wire", "native"]  # (the rank trajectory below was worked out in float32)
    a, b, straight = _straight_and_resumed(data_dir, tmp_path, common, 7, 15)  # stopped mid-window
    assert a == b
    train = _train_records(straight)
    ranks = [r["rank"] for r in train]
    assert ranks[:2] == [0, 0] and all(r > 0 for r in ranks[2:]) and len(set(ranks[2:])) >= 3, ranks
    expected, rank = [], 8  # steps 3..15: r_max until the first window end after the start, then the rule
    for step in range(3, 16):
        expected.append(rank)
        if step % 3 == 0:
            noise = train[step - 1]["noise_scale"]
            rank = next_noise_rank(noise, 2, rank, r_min=2, r_max=8, exponent=4.0, rank_step=4, multiple=2)
    assert ranks[2:] == expected, (ranks, [r["noise_scale"] for r in train[2::3]])
    proc = _edgc(*_train(data_dir, tmp_path / "bad", "--edgc-warmup-max-error", "0"), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "edgc train: error: EDGCConfig.warmup_max_error=0.0: must be in (0, 1]"]


def test_compression_starts_once_the_learning_rate_warmup_has_ended(tmp_path, data_dir):
    # checks every 2nd step (alpha 1/2) and any error passes: without a floor the warm-up
    # ends at the first check, step 2; edgc train floors it at the learning rate's warm-up
    # (5 steps), so compression starts at step 6; --edgc-warmup-min-steps 0 takes the floor away
    common = ["--method", "edgc", "--steps", "10", "--eval-every", "10", "--lr-warmup-steps", "5",
              "--edgc-iteration-sample-rate", "0.5", "--edgc-warmup-steps", "8", "--edgc-warmup-max-error", "1"]
    floored, bare = tmp_path / "floored", tmp_path / "bare"
    assert main(_train(data_dir, floored, *common)) == 0
    assert main(_train(data_dir, bare, *common, "--edgc-warmup-min-steps", "0")) == 0
    assert [r["rank"] for r in _train_records(floored)] == [0] * 5 + [4] * 5
    assert [r["rank"] for r in _train_records(bare)] == [0] * 2 + [4] * 8
    assert json.loads((floored / "config.json").read_text())["edgc"]["warmup_min_steps"] == 5
    proc = _edgc(*_train(data_dir, tmp_path / "bad", *common, "--edgc-warmup-min-steps", "9"), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "edgc train: error: EDGCConfig.warmup_min_steps=9: must be at most warmup_steps (8)"]


HSDP = ["--dp-shard", "2", "--dp-replicate", "2", "--steps", "6", "--eval-every", "3", "--checkpoint-every", "3",
        "--edgc-warmup-steps", "2", "--edgc-window", "2", "--grad-accum", "2", "--device", "cpu"]


@pytest.mark.slow
def test_hsdp_through_the_cli_compresses_after_an_int8_warmup_and_resumes_exactly(tmp_path, data_dir):
    a, b, straight = _straight_and_resumed(data_dir, tmp_path, ["--method", "edgc", *HSDP], 3, 6)
    assert a == b
    train = _train_records(straight)
    assert [r["rank"] for r in train] == [0, 0, 4, 4, 4, 4]
    assert all(r["bytes_sent"] < r["bytes_uncompressed"] / 2 for r in train[2:])
    native = tmp_path / "native"
    assert main(_train(data_dir, native, "--method", "none", *HSDP)) == 0
    plain = _train_records(native)
    # the warm-up sends every tensor whole, in the default int8 wire format: native HSDP's
    # steps up to that rounding, at about a quarter of the bytes
    assert plain[0]["loss"] == train[0]["loss"]
    assert all(abs(p["loss"] - t["loss"]) < 1e-2 for p, t in zip(plain[:3], train[:3], strict=True))
    assert all(r["bytes_sent"] < 0.3 * r["bytes_uncompressed"] for r in train[:2])
    assert all(r["bytes_sent"] == r["bytes_uncompressed"] > 0 for r in plain)
    assert json.loads((straight / "config.json").read_text())["dp_shard"] == 2
    assert (straight / "summary.md").is_file() and (straight / "loss.png").is_file()


def test_hsdp_refusals_are_one_line(tmp_path, data_dir, capsys):
    assert main(_train(data_dir, tmp_path / "a", "--dp-shard", "2", "--pp", "2")) == 2
    assert "pipelines" in capsys.readouterr().err
    assert main(_train(data_dir, tmp_path / "b", "--dp-shard", "2", "--method", "torch-powersgd")) == 2
    assert "not supported with HSDP" in capsys.readouterr().err
    assert main(_train(data_dir, tmp_path / "c", "--dp-shard", "3", "--nproc", "4")) == 2
    assert "dp_shard(3)" in capsys.readouterr().err
    assert main(_train(data_dir, tmp_path / "d", "--dp-shard", "2", "--dtype", "fp16")) == 2
    assert "bf16" in capsys.readouterr().err
    assert not any((tmp_path / x).exists() for x in "abcd")
