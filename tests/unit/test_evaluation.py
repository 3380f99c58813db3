"""The evaluation set, the validation loss and its standard error, and how reports use it."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from edgc.cli import main
from edgc.data import TokenFile, write_token_file
from edgc.models import build_model
from edgc.train.blocks import (
    BlockLosses,
    block_losses_by_step,
    keep_block_losses_until,
    load_block_losses,
    paired_difference,
    save_block_losses,
)
from edgc.train.config import TrainConfig
from edgc.train.evaluation import LossMoments, block_losses, eval_batches, eval_starts
from edgc.train.metrics import perplexity
from edgc.train.summary import compare_loss
from edgc.train.trainer import evaluate


def test_eval_starts_cover_the_split_with_disjoint_blocks():
    starts = eval_starts(1001, 100)
    assert starts.tolist() == list(range(0, 1000, 100))  # (1001 - 1) // 100 = 10 blocks, targets fit
    assert eval_starts(1000, 100).tolist() == list(range(0, 900, 100))  # the 10th block lacks its last target
    capped = eval_starts(100_001, 100, max_tokens=2_500)
    assert len(capped) == 25 and np.all(np.diff(capped) >= 100)  # disjoint
    assert capped[0] == 0 and capped[-1] >= 96_000  # spread over the whole split, not its start
    assert np.all(capped % 100 == 0)  # on the grid
    assert eval_starts(100_001, 100, max_tokens=1).tolist() == [0]
    with pytest.raises(ValueError, match="block_size"):
        eval_starts(100, 100)


def test_eval_batches_pad_the_last_batch_and_say_so():
    data = np.arange(1000, dtype=np.int64)
    starts = eval_starts(len(data), 10)[:7]
    batches = list(eval_batches(data, starts, 10, 3, torch.device("cpu")))
    assert [b.valid for b in batches] == [3, 3, 1]
    assert all(b.x.shape == (3, 10) for b in batches)
    assert torch.equal(batches[0].x[1], torch.arange(10, 20)) and torch.equal(batches[0].y[1], torch.arange(11, 21))
    assert torch.equal(batches[2].x[1], batches[2].x[0])  # padding repeats the first block


def test_standard_error_matches_a_direct_computation():
    gen = torch.Generator().manual_seed(0)
    losses = 5.0 + 0.4 * torch.randn(1000, generator=gen, dtype=torch.float64)
    moments = LossMoments(torch.device("cpu"))
    for chunk in losses.split(64):
        moments.add(chunk)
    result = moments.result(block_size=128)
    assert result.blocks == 1000 and result.tokens == 128_000
    assert math.isclose(result.loss, float(losses.mean()), rel_tol=1e-13)
    assert math.isclose(result.se, float(losses.std() / math.sqrt(1000)), rel_tol=1e-10)
    one = LossMoments(torch.device("cpu"))
    one.add(losses[:1])
    assert math.isnan(one.result(128).se)


def test_block_losses_are_per_block_cross_entropy():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 7, generator=gen)
    targets = torch.randint(7, (3, 5), generator=gen)
    per_block = block_losses(logits, targets)
    assert per_block.dtype == torch.float64 and per_block.shape == (3,)
    for b in range(3):
        assert math.isclose(float(per_block[b]), float(F.cross_entropy(logits[b], targets[b])), rel_tol=1e-6)


@pytest.fixture
def val_file(tmp_path):
    ids = np.random.default_rng(0).integers(0, 64, size=32 * 20 + 1 + 7)  # 20 blocks of 32, and a tail
    write_token_file([ids], tmp_path / "val.bin", vocab_size=64, tokenizer_name="test")
    return TokenFile(tmp_path / "val.bin")


def test_evaluate_is_deterministic_covers_every_block_and_matches_by_hand(val_file):
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=64, block_size=32)
    cfg = TrainConfig(block_size=32, batch_size=6, eval_tokens=None)
    first = evaluate(model, val_file, cfg, rank=0, world=1, device=torch.device("cpu"))
    assert model.training  # left in training mode
    again = evaluate(model, val_file, cfg, rank=0, world=1, device=torch.device("cpu"))
    assert (first.loss, first.se, first.blocks) == (again.loss, again.se, again.blocks)
    assert first.blocks == 20 and first.tokens == 640

    model.eval()
    with torch.no_grad():
        by_hand = torch.stack([
            F.cross_entropy(model(torch.from_numpy(val_file.tokens[s : s + 32].astype(np.int64))[None])[0][0],
                            torch.from_numpy(val_file.tokens[s + 1 : s + 33].astype(np.int64))).double()
            for s in range(0, 640, 32)
        ])
    assert math.isclose(first.loss, float(by_hand.mean()), rel_tol=1e-6)
    assert math.isclose(first.se, float(by_hand.std() / math.sqrt(20)), rel_tol=1e-4)
    # each block's loss, in the order of eval_starts
    assert first.losses is not None and first.losses.shape == (20,)
    np.testing.assert_allclose(first.losses, by_hand.numpy(), rtol=1e-6)
    assert math.isclose(float(first.losses.mean()), first.loss, rel_tol=1e-12)

    capped = evaluate(model, val_file, TrainConfig(block_size=32, batch_size=6, eval_tokens=5 * 32),
                      rank=0, world=1, device=torch.device("cpu"))
    assert capped.blocks == 5


def test_each_replica_fills_in_its_own_blocks(val_file):
    """Block i is replica i mod world's: three replicas' block losses, summed as the
    all-reduce sums them, are the one-replica evaluation's, block for block."""
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=64, block_size=32)
    cfg = TrainConfig(block_size=32, batch_size=4, eval_tokens=None)
    whole = evaluate(model, val_file, cfg, rank=0, world=1, device=torch.device("cpu"))
    parts = [evaluate(model, val_file, cfg, rank=r, world=3, device=torch.device("cpu")) for r in range(3)]
    for r, part in enumerate(parts):
        assert part.losses is not None
        held = np.flatnonzero(part.losses)
        np.testing.assert_array_equal(held, np.arange(20)[r::3])  # (only its own blocks)
    assert whole.losses is not None
    np.testing.assert_allclose(sum(p.losses for p in parts if p.losses is not None), whole.losses, rtol=1e-6)


def test_loss_moments_refuse_block_losses_without_their_numbers():
    moments = LossMoments(torch.device("cpu"), starts=np.arange(4, dtype=np.int64) * 8)
    with pytest.raises(ValueError, match="block numbers"):
        moments.add(torch.ones(2))
    moments.add(torch.tensor([1.0, 3.0]), np.array([3, 1]))
    result = moments.result(block_size=8)
    assert result.losses is not None
    np.testing.assert_array_equal(result.losses, [0.0, 3.0, 0.0, 1.0])
    assert LossMoments(torch.device("cpu")).result(block_size=8).losses is None


def test_block_losses_round_trip_and_pair(tmp_path):
    starts = np.arange(0, 800, 80, dtype=np.int64)
    rng = np.random.default_rng(1)
    a = rng.normal(4.0, 0.5, size=10)
    b = a + 0.01 + rng.normal(0, 0.001, size=10)  # b: 0.01 above a, nearly the same errors
    save_block_losses(tmp_path / "a", 500, starts, a)
    save_block_losses(tmp_path / "b", 500, starts, b)
    la, lb = load_block_losses(tmp_path / "a"), load_block_losses(tmp_path / "b")
    assert la is not None and lb is not None and la.step == 500
    np.testing.assert_array_equal(la.starts, starts)
    np.testing.assert_array_equal(la.losses, a)  # (bit for bit)
    diff, se = paired_difference(lb, la)
    assert math.isclose(diff, float((b - a).mean()), rel_tol=1e-12)
    assert math.isclose(se, float((b - a).std(ddof=1) / math.sqrt(10)), rel_tol=1e-12)
    combined = math.hypot(a.std(ddof=1), b.std(ddof=1)) / math.sqrt(10)
    assert se < combined / 50  # (the paired SE sees through the blocks' shared spread)
    assert load_block_losses(tmp_path) is None  # (no file: a run from before they were kept)
    assert load_block_losses(tmp_path / "a", 500) is not None
    assert load_block_losses(tmp_path / "a", 499) is None  # (another evaluation's: they would not pair)


def test_block_losses_refuse_other_blocks_and_files_that_are_not_theirs(tmp_path):
    one = BlockLosses(step=1, starts=np.arange(4, dtype=np.int64) * 8, losses=np.ones(4))
    other = BlockLosses(step=1, starts=np.arange(4, dtype=np.int64) * 16, losses=np.ones(4))
    with pytest.raises(ValueError, match="not of the same blocks"):
        paired_difference(one, other)
    with pytest.raises(ValueError, match="1-D and of one length"):
        save_block_losses(tmp_path, 1, np.arange(3), np.ones(4))
    (tmp_path / "val_blocks.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not an edgc block-loss file"):
        load_block_losses(tmp_path)
    # training does not stop over it: the next evaluation's losses replace it
    save_block_losses(tmp_path, 5, np.arange(4), np.ones(4))
    assert sorted(block_losses_by_step(tmp_path)) == [5]
    (tmp_path / "val_blocks.npz").write_bytes(b"not a zip")
    np.savez(tmp_path / "val_blocks.npz", step=1, starts=np.array([object()], dtype=object), losses=np.ones(1))
    with pytest.raises(ValueError, match="not an edgc block-loss file"):
        load_block_losses(tmp_path)  # (an object array would need pickles: refused)


# ---------------------------------------------------------------------------- reports


def test_compare_loss_says_when_a_difference_is_within_the_standard_error():
    assert compare_loss(5.006, 0.005, 5.0, 0.005) == "+0.12% (within SE)"  # 0.006 <= sqrt(2) * 0.005
    assert compare_loss(4.99, 0.005, 5.0, 0.005) == "-0.20% (beyond SE)"
    assert compare_loss(5.01, math.nan, 5.0, 0.004) == "+0.20%"  # an old run without an SE
    assert compare_loss(math.nan, 0.0, 5.0, 0.004) == "—"


def _fake_run(folder, val_loss: float, se: float) -> None:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"method": "none", "preset": "tiny", "block_size": 32}))
    train = {"kind": "train", "loss": 5.0, "lr": 1e-3, "tokens_per_s": 1.0, "step_time": 0.1, "comm_time": 0.01,
             "bytes_sent": 100, "bytes_uncompressed": 100, "rank": 0, "entropy": 0.0, "phase": "warmup"}
    lines = [{"step": s, **train} for s in (1, 2)]
    lines.append({"step": 2, "kind": "val", "val_loss": val_loss, "val_loss_se": se, "val_ppl": perplexity(val_loss),
                  "val_tokens": 6400, "val_time": 0.5})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_edgc_report_marks_differences_within_and_beyond_the_standard_error(tmp_path, capsys):
    _fake_run(tmp_path / "a", 5.000, 0.005)
    _fake_run(tmp_path / "b", 5.006, 0.005)
    _fake_run(tmp_path / "c", 4.950, 0.005)
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "c"),
                 "--out", str(tmp_path / "rep")]) == 0
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")}
    assert "| 5.0000 ± 0.0050 | — |" in rows["a"]
    assert "| 5.0060 ± 0.0050 | +0.12% (within SE) |" in rows["b"]
    assert "| 4.9500 ± 0.0050 | -1.00% (beyond SE) |" in rows["c"]
    assert "within SE" in (tmp_path / "rep" / "report.md").read_text()


def test_compare_loss_pairs_the_blocks_when_it_can():
    # 0.006 above, within the combined SE (0.0071) but many paired SEs
    assert compare_loss(5.006, 0.005, 5.0, 0.005, (0.006, 0.0005)) == "+0.12% (+0.0060 ± 0.0005 paired: beyond SE)"
    assert compare_loss(5.0004, 0.005, 5.0, 0.005, (0.0004, 0.0005)) == "+0.01% (+0.0004 ± 0.0005 paired: within SE)"
    assert compare_loss(5.006, 0.005, 5.0, 0.005, (0.006, math.nan)) == "+0.12% (within SE)"  # (one block)


def test_edgc_report_pairs_runs_that_kept_their_block_losses(tmp_path, capsys):
    """b is 0.006 above a on every block but with the same spread: within the combined SE,
    beyond the paired one; c kept the block losses of another evaluation than its last and d
    was evaluated on other blocks, so both are compared as before."""
    starts = np.arange(100, dtype=np.int64) * 32
    hard = np.random.default_rng(0).normal(0.0, 0.05, size=100)
    for name, loss in (("a", 5.0), ("b", 5.006), ("c", 5.006), ("d", 5.006)):
        _fake_run(tmp_path / name, loss, 0.005)
        jitter = np.random.default_rng(ord(name)).normal(0.0, 0.001, size=100)
        losses = loss + hard - hard.mean() + jitter - jitter.mean()
        save_block_losses(tmp_path / name, 1 if name == "c" else 2, starts * (2 if name == "d" else 1), losses)
    assert main(["report", *(str(tmp_path / n) for n in "abcd"), "--out", str(tmp_path / "rep")]) == 0
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")}
    assert "| +0.12% (+0.0060 ± 0.0001 paired: beyond SE) |" in rows["b"]
    assert "| +0.12% (within SE) |" in rows["c"] and "| +0.12% (within SE) |" in rows["d"]
    assert "paired" in (tmp_path / "rep" / "report.md").read_text()


def test_a_diverged_run_is_logged_summarised_and_reported(tmp_path, capsys):
    # a loss of 1000 nats (--lr 100) overflows exp(); the writer logs inf and nan as null
    from edgc.train.evaluation import EvalResult, val_record
    from edgc.train.metrics import MetricsWriter, read_metrics
    from edgc.train.summary import write_summary

    record = val_record(5, EvalResult(loss=1000.0, se=1.0, blocks=4, tokens=128, seconds=0.1))
    assert record["val_ppl"] == math.inf
    _fake_run(tmp_path / "ok", 5.0, 0.005)
    _fake_run(tmp_path / "nan", 5.0, 0.005)
    writer = MetricsWriter(tmp_path / "nan" / "metrics.jsonl", resume_step=2)
    writer.write(val_record(2, EvalResult(loss=math.nan, se=math.nan, blocks=4, tokens=128, seconds=0.1)))
    writer.close()
    assert read_metrics(tmp_path / "nan" / "metrics.jsonl")[-1]["val_loss"] is None
    text = write_summary(tmp_path / "nan").read_text()
    assert "not finite" in text and "diverged" in text
    assert main(["report", str(tmp_path / "ok"), str(tmp_path / "nan"), "--out", str(tmp_path / "rep")]) == 0
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")}
    assert "| not finite | — |" in rows["nan"]


def test_a_finite_loss_too_large_for_exp_is_summarised_and_reported(tmp_path, capsys):
    # --lr 100: a finite validation loss of 5.7e5 nats; exp() of it overflows
    from edgc.train.summary import write_summary

    assert perplexity(709.0) == math.exp(709.0) and perplexity(710.0) == math.inf == perplexity(math.inf)
    assert math.isnan(perplexity(math.nan))
    _fake_run(tmp_path / "ok", 5.0, 0.005)
    _fake_run(tmp_path / "huge", 573954.1145, 14178.3)
    assert "| 573954.1145 ± 14178.3000 |" in write_summary(tmp_path / "huge").read_text()
    assert main(["report", str(tmp_path / "ok"), str(tmp_path / "huge"), "--out", str(tmp_path / "rep")]) == 0
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")}
    assert rows["huge"].split("|")[6].strip() == "inf"  # val ppl


@pytest.mark.parametrize("content,message", [
    (b'{"method": "none",', "'bad/config.json' is not valid JSON (Expecting property name"),
    (b"\xff{}", "'bad/config.json' is not valid JSON ('utf-8' codec can't decode byte 0xff"),
    (b"[1, 2]", "'bad/config.json' must hold a JSON object of the run's settings"),
])
def test_edgc_report_names_a_broken_config_json(tmp_path, content, message):
    _fake_run(tmp_path / "bad", 5.0, 0.005)
    (tmp_path / "bad" / "config.json").write_bytes(content)
    proc = subprocess.run([sys.executable, "-m", "edgc", "report", "bad", "--out", "rep"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith(f"edgc report: error: {message}"), proc.stderr
    assert proc.stderr.count("\n") == 1 and not (tmp_path / "rep").exists()


@pytest.mark.parametrize("layout,one_replica", [
    ({"world_size": 1}, True),
    ({"world_size": 2}, False),
    ({"world_size": 2, "pp": 2}, True),  # (two stages of one replica)
    ({"world_size": 1, "dp_shard": 1, "dp_replicate": 1}, True),  # (HSDP on a 1 x 1 mesh)
    ({"world_size": 4, "dp_shard": 2, "dp_replicate": 2}, False),
    ({"world_size": 2, "dp_shard": 2, "dp_replicate": None}, True),  # (FSDP2 over one node)
])
def test_a_summary_of_one_replica_says_no_bytes_crossed_a_link(tmp_path, layout, one_replica):
    # (a one-worker run on the lent GPU once read "0.0 MB sent ... (89322.67x fewer)")
    from edgc.train.summary import write_summary

    _fake_run(tmp_path / "run", 5.0, 0.005)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    (tmp_path / "run" / "config.json").write_text(json.dumps({**config, **layout}))
    text = write_summary(tmp_path / "run").read_text()
    assert ("Bytes: none cross a link, with one replica." in text) == one_replica
    assert ("MB for uncompressed all-reduce" in text) != one_replica
    assert ("1 worker," in text) == (layout["world_size"] == 1)


def test_every_evaluation_s_block_losses_are_kept_and_a_resumed_run_drops_what_it_evaluates_again(tmp_path):
    starts = np.arange(0, 400, 40, dtype=np.int64)
    rows = {step: np.random.default_rng(step).normal(4.0, 0.5, size=10) for step in (100, 200, 300)}
    for step, losses in rows.items():
        save_block_losses(tmp_path, step, starts, losses)
    kept = block_losses_by_step(tmp_path)
    assert sorted(kept) == [100, 200, 300]
    for step, losses in rows.items():
        np.testing.assert_array_equal(kept[step].losses, losses)  # (bit for bit)
        assert load_block_losses(tmp_path, step).step == step
    assert load_block_losses(tmp_path).step == 300  # (no step: the last evaluation's)
    # resumed from a checkpoint at step 100: its evaluation at 200 replaces the earlier attempt's 200 and 300
    again = rows[200] + 1.0
    save_block_losses(tmp_path, 200, starts, again)
    kept = block_losses_by_step(tmp_path)
    assert sorted(kept) == [100, 200]
    np.testing.assert_array_equal(kept[200].losses, again)
    np.testing.assert_array_equal(kept[100].losses, rows[100])
    # evaluated on other blocks (another eval_tokens): the rows of the old ones would not pair with it
    save_block_losses(tmp_path, 400, starts * 2, rows[300])
    assert sorted(block_losses_by_step(tmp_path)) == [400]


def test_a_resume_cuts_the_block_losses_back_to_its_checkpoint_with_the_metrics(tmp_path):
    """A resumed run that stops before its next evaluation must not keep an earlier
    attempt's rows past its checkpoint, which its metrics.jsonl no longer has."""
    from edgc.train.metrics import MetricsWriter, read_metrics

    starts = np.arange(0, 400, 40, dtype=np.int64)
    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    for step in (100, 200, 300):
        writer.write({"step": step, "kind": "val", "val_loss": 4.0})
        save_block_losses(tmp_path, step, starts, np.full(10, 4.0 + step))
    writer.close()
    MetricsWriter.for_run(TrainConfig(out=str(tmp_path)), resume_step=250).close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [100, 200]
    assert sorted(block_losses_by_step(tmp_path)) == [100, 200]
    assert block_losses_by_step(tmp_path)[200].losses[0] == 204.0
    keep_block_losses_until(tmp_path, 50)  # (nothing left: no file)
    assert not (tmp_path / "val_blocks.npz").exists()


def test_a_block_loss_file_of_the_first_format_still_loads(tmp_path):
    starts, losses = np.arange(4, dtype=np.int64) * 8, np.array([4.0, 4.5, 3.5, 4.25])
    np.savez(tmp_path / "val_blocks.npz", step=np.int64(500), starts=starts, losses=losses)
    assert sorted(block_losses_by_step(tmp_path)) == [500]
    np.testing.assert_array_equal(load_block_losses(tmp_path, 500).losses, losses)
    assert load_block_losses(tmp_path, 400) is None
    save_block_losses(tmp_path, 600, starts, losses + 1)  # (a run resumed with this release adds its rows)
    assert sorted(block_losses_by_step(tmp_path)) == [500, 600]
    np.savez(tmp_path / "val_blocks.npz", steps=np.array([1, 2]), starts=starts, losses=np.ones((3, 4)))
    with pytest.raises(ValueError, match="not an edgc block-loss file"):
        block_losses_by_step(tmp_path)  # (two steps, three rows)
