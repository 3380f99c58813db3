"""Pipeline × data-parallel training (`edgc train --pp`): equivalence, replicas, DAC, resume."""

import json
import math

import pytest

from edgc.policy.dac import TimeModel, stage_rank
from edgc.train.checkpoint import CHECKPOINT_NAME, load_checkpoint
from edgc.train.config import TrainConfig
from edgc.train.launch import run_local
from edgc.train.metrics import read_metrics
from edgc.train.trainer import prepare_run, train_worker


def _run(data_dir, out, nproc, resume=False, **kw):
    """Train on `nproc` local workers; returns (per-rank results, metrics records)."""
    values = dict(data=str(data_dir), out=str(out), nproc=nproc, batch_size=4, block_size=32, eval_tokens=256,
                  progress=False, rank=8, steps=8, eval_every=4, seed=5)
    values.update(kw)
    ckpt = str(out / CHECKPOINT_NAME) if resume else None
    cfg = prepare_run(TrainConfig.from_dict(values), ckpt, nproc)
    results = run_local(train_worker, nproc, cfg.to_dict(), str(data_dir), ckpt, timeout=300, threads=1)
    return results, read_metrics(out / "metrics.jsonl")


def _losses(records, kind="train", key="loss"):
    return [r[key] for r in records if r["kind"] == kind]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_uncompressed_pipeline_matches_unsplit_model(tmp_path, data_dir, schedule):
    _, unsplit = _run(data_dir, tmp_path / "unsplit", 1, method="none", steps=6, eval_every=3)
    _, piped = _run(data_dir, tmp_path / schedule, 2, method="none", steps=6, eval_every=3,
                    pp=2, schedule=schedule, microbatches=2)
    for a, b in [(_losses(unsplit), _losses(piped)),
                 (_losses(unsplit, "val", "val_loss"), _losses(piped, "val", "val_loss"))]:
        assert len(a) == len(b) and len(a) > 0
        for x, y in zip(a, b, strict=True):
            assert math.isclose(x, y, rel_tol=1e-5), (a, b)
    assert unsplit[0]["loss"] > _losses(unsplit)[-1]  # it did train


def test_activation_gradients_full_rank_exact_and_low_rank_trains(tmp_path, data_dir):
    _, unsplit = _run(data_dir, tmp_path / "unsplit", 1, method="none", steps=4, eval_every=2)
    # block 32 x width 128: rank 32 is the whole matrix, so compression must be exact
    _, full = _run(data_dir, tmp_path / "full", 2, method="none", steps=4, eval_every=2, pp=2, microbatches=2,
                   activation_rank=32)
    for x, y in zip(_losses(unsplit), _losses(full), strict=True):
        assert math.isclose(x, y, rel_tol=1e-5), (_losses(unsplit), _losses(full))
    _, low = _run(data_dir, tmp_path / "low", 2, method="none", steps=8, eval_every=4, pp=2, microbatches=2,
                  activation_rank=2)
    train = [r for r in low if r["kind"] == "train"]
    assert all(math.isfinite(r["loss"]) for r in train) and train[-1]["loss"] < train[0]["loss"]
    # stage 1 sends 2 micro-batches of (2, 32 + 128, 2) float32 back, not (2, 32, 128)
    assert train[-1]["stage_p2p_bytes"][1] == 2 * 2 * 160 * 2 * 4


def _dac_decisions(results):
    return [d for r in results for d in r["decisions"]]


def test_pp2_dp2_edgc_replicas_identical_and_dac_follows_rule(tmp_path, data_dir):
    results, records = _run(data_dir, tmp_path / "run", 4, method="edgc", steps=12, pp=2, microbatches=2,
                            edgc={"warmup_steps": 3, "window": 3, "iteration_sample_rate": 1.0, "min_rank": 2})
    train = [r for r in records if r["kind"] == "train"]
    assert all(math.isfinite(r["loss"]) for r in train)
    assert all(len(r["stage_rank"]) == 2 and len(r["stage_sync_end"]) == 2 and len(r["stage_idle_time"]) == 2
               for r in train)
    # replicas of a stage (ranks p*2 + d) end bit-identical
    digests = [r["param_digest"] for r in results]
    assert digests[0] == digests[1] and digests[2] == digests[3] and digests[0] != digests[2]
    # the DAC rule on this run's own measured timings
    decisions = _dac_decisions(results)
    assert decisions, "no DAC decision was made"
    logged = [json.loads(line) for line in (tmp_path / "run" / "dac.jsonl").read_text().splitlines()]
    assert sorted((d["step"], d["stage"], d["local"] or 0) for d in logged) == \
        sorted((d["step"], d["stage"], d["local"] or 0) for d in decisions)
    for d in decisions:
        if d["stage_ranks"] == "dac" and d["model"] is not None:
            model = TimeModel.from_dict(d["model"])
            t_unc = d["t_uncompressed"] if d["t_uncompressed"] is not None else math.inf
            assert d["local"] == stage_rank(d["stage"], model, d["r0"], d["t0"], d["t_mb"], d["r_max"], t_unc)
        if d["stage"] == 0:
            assert d["r0"] == d["r_entropy"] or d["model"] is None
    for step in {d["step"] for d in decisions}:
        for stage in (0, 1):
            both = [d for d in decisions if d["step"] == step and d["stage"] == stage]
            assert len(both) == 2
            local = [d["local"] if d["local"] is not None else d["r_max"] + 1 for d in both]
            agreed = {d["rank"] for d in both}
            assert len(agreed) == 1
            want = max(local)
            assert agreed.pop() == (None if want > both[0]["r_max"] else want)
    # the logged stage ranks are the agreed ones
    last = max(d["step"] for d in decisions)
    after = next(r for r in train if r["step"] == last + 1) if last < 12 else None
    if after is not None:
        for stage in (0, 1):
            rank = next(d for d in decisions if d["step"] == last and d["stage"] == stage)["rank"]
            assert after["stage_rank"][stage] == (rank or 0)


GIVEN = {"eta": 0.001, "t_mb": 0.004, "t_uncompressed": 1.0}  # deterministic DAC: T = 1 ms per rank


def test_dac_given_timings_gives_later_stage_more_rank(tmp_path, data_dir):
    results, _ = _run(data_dir, tmp_path / "run", 4, method="edgc", steps=9, pp=2, microbatches=2, rank=16,
                            edgc={"warmup_steps": 3, "window": 3, "iteration_sample_rate": 1.0, "min_rank": 4},
                            dac=GIVEN)
    for d in _dac_decisions(results):
        if d["stage"] == 1:
            # T_1 = t_mb + T(r0) = 4 ms + r0 ms: r_1 = r0 + 4, rounded up to a multiple of 4
            want = -(-(d["r0"] + 4) // 4) * 4
            assert d["rank"] == (want if want <= 16 else None)


@pytest.mark.slow
def test_pipeline_resume_continues_exactly(tmp_path, data_dir):
    common = dict(method="edgc", steps=12, pp=2, microbatches=2, rank=16, checkpoint_every=6, dac=GIVEN,
                  activation_rank=4,
                  edgc={"warmup_steps": 3, "window": 3, "iteration_sample_rate": 1.0, "min_rank": 4})
    _, straight = _run(data_dir, tmp_path / "straight", 4, **common)
    _run(data_dir, tmp_path / "split", 4, stop_after=6, **common)
    assert load_checkpoint(tmp_path / "split" / CHECKPOINT_NAME)["step"] == 6
    _, resumed = _run(data_dir, tmp_path / "split", 4, resume=True, **common)
    assert _losses(resumed) == _losses(straight)
    assert _losses(resumed, "val", "val_loss") == _losses(straight, "val", "val_loss")
    assert [r["stage_rank"] for r in resumed if r["kind"] == "train"] == \
        [r["stage_rank"] for r in straight if r["kind"] == "train"]


def test_layout_errors_show_the_arithmetic(tmp_path, data_dir):
    with pytest.raises(ValueError, match=r"pp\(2\) \* dp\(2\) != world\(6\)"):
        TrainConfig(pp=2, dp=2, nproc=6).validate()
    with pytest.raises(ValueError, match=r"pp\(2\) \* dp\(1\) != world\(3\)"):
        TrainConfig(pp=2, nproc=3).validate()
    with pytest.raises(ValueError, match="torch-powersgd"):
        TrainConfig(pp=2, nproc=2, method="torch-powersgd").validate()
    with pytest.raises(ValueError, match="microbatches"):
        TrainConfig(pp=2, nproc=2, batch_size=6, microbatches=4).validate()
    with pytest.raises(ValueError, match="unknown DAC option"):
        TrainConfig(pp=2, nproc=2, dac={"bogus": 1}).validate()


@pytest.mark.slow
def test_pipeline_under_torchrun_and_layout_error(tmp_path, data_dir):
    import subprocess
    import sys

    from edgc.train.launch import free_port

    def torchrun(out, *extra):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
               "--master-port", str(free_port()),
               "-m", "edgc", "train", "--data", str(data_dir), "--out", str(out), "--batch-size", "4",
               "--block-size", "32", "--eval-tokens", "256", "--no-progress", "--rank", "4", "--method", "edgc",
               "--steps", "4", "--edgc-warmup-steps", "1", "--edgc-window", "2", "--microbatches", "2", *extra]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=240)

    proc = torchrun(tmp_path / "ok", "--pp", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "ok" / "config.json").read_text())["world_size"] == 4
    train = [r for r in read_metrics(tmp_path / "ok" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4] and len(train[-1]["stage_rank"]) == 2
    bad = torchrun(tmp_path / "bad", "--pp", "2", "--dp", "3")
    assert bad.returncode != 0 and "pp(2) * dp(3) != world(4)" in bad.stderr
