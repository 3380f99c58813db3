"""Mixture of experts: the route a user's script takes (edgc.moe, register_edgc with
expert_mesh) on 4 gloo processes, and `edgc train --preset tiny-moe --ep 2 --nproc 4` as
the README writes it."""

import io
import json
import math

import pytest
import torch

import moe_workers
from edgc.cli import main
from edgc.train.checkpoint import CHECKPOINT_NAME
from edgc.train.metrics import read_metrics
from harness import assert_same, run_workers, train_args

pytestmark = pytest.mark.slow

# native wire in the warm-up check; a rank that moves within a short run
BASE = dict(max_rank=4, min_rank=2, rank_step=2, window=2, warmup_steps=2, iteration_sample_rate=1.0,
            warmup="fixed", min_compression_rate=1.0, noise={"exponent": 2.0}, wire="native")


def _replicas_identical(out):
    """Dense parameters equal on every process; experts on the processes of one EP rank."""
    names = set(out[0]["names"])
    for r in out[1:]:
        for n, p in r["params"].items():
            if n not in names:
                assert torch.equal(p, out[0]["params"][n]), n
    for r in out:
        for s in out:
            if s["ep_rank"] == r["ep_rank"]:
                for n in names:
                    assert torch.equal(r["params"][n], s["params"][n]), n


@pytest.mark.parametrize("layout", [(4, 1), (2, 2)])
def test_dense_and_experts_are_averaged_over_their_own_groups_then_compressed_with_replicas_identical(layout):
    steps = 8
    out = run_workers(moe_workers.train, 4, layout, 2, BASE, steps)
    want = moe_workers.reference(4, steps)
    names = set(out[0]["names"])
    for r in out:  # the first step (warm-up, sent whole) is the one-process average
        share = 8 // 2
        for n, g in r["first_grads"].items():
            ref = want[n][r["ep_rank"] * share:(r["ep_rank"] + 1) * share] if n in names else want[n]
            assert torch.allclose(g, ref, rtol=1e-4, atol=1e-7), n
    _replicas_identical(out)
    for key in ("ranks", "expert_ranks"):  # each group agrees its rank; compressed after the warm-up
        assert all(r[key] == out[0][key] for r in out), key
        assert out[0][key][:2] == [0, 0] and all(x > 0 for x in out[0][key][2:]), out[0][key]
    for r in out:
        for stats in (r["stats"], r["expert_stats"]):
            assert stats.compressed_steps == steps - 2 and stats.nonfinite_steps == 0
            assert stats.bytes_sent < stats.bytes_uncompressed
        assert r["a2a"] > 0
        assert all(math.isfinite(x) for x in r["losses"])


def test_an_expert_no_token_reaches_stays_finite_and_identical():
    out = run_workers(moe_workers.train, 4, (4, 1), 2, BASE, 6, True)
    _replicas_identical(out)
    for r in out:
        assert all(math.isfinite(x) for x in r["losses"])
        assert all(torch.isfinite(p).all() for p in r["params"].values())
        assert r["expert_stats"].nonfinite_steps == 0 and r["expert_stats"].compressed_steps == 4
    idle = out[0]  # EP rank 0 holds expert 0: its weights never moved (no gradient, no error fed back)
    assert idle["ep_rank"] == 0
    torch.manual_seed(0)
    fresh = moe_workers.build_model(moe_workers.PRESET, block_size=32)
    assert torch.equal(idle["params"]["h.0.mlp.experts.w_fc"][0], fresh.h[0].mlp.experts.w_fc[0].detach())


def test_a_resumed_run_repeats_the_uninterrupted_one():
    straight = run_workers(moe_workers.train, 4, (4, 1), 2, BASE, 8)
    part = run_workers(moe_workers.train, 4, (4, 1), 2, BASE, 5)
    blob = io.BytesIO()
    torch.save({"model": [torch.load(io.BytesIO(r["model"]), weights_only=False) for r in part],
                "state": [r["state"] for r in part]}, blob)
    rest = run_workers(moe_workers.train, 4, (4, 1), 2, BASE, 3, False, blob.getvalue(), 5)
    for a, b in zip(straight, rest, strict=True):
        assert a["losses"][5:] == b["losses"]
        assert_same(a["params"], b["params"], "params")
        assert a["expert_ranks"][5:] == b["expert_ranks"]
    assert "ep" in part[0]["state"] and part[0]["state"]["ep"] == 2


def test_the_experts_take_settings_of_their_own():
    # the experts at static rank 2 in the int8 wire, the dense gradients at the moving rank
    # (2 to 4) in the native wire: each core keeps its own, and replicas stay identical
    experts = {**BASE, "policy": "static", "max_rank": 2, "wire": "int8"}
    out = run_workers(moe_workers.train, 4, (4, 1), 2, BASE, 8, False, None, 0, experts)
    _replicas_identical(out)
    assert out[0]["expert_ranks"] == [0, 0] + [2] * 6
    assert 4 in out[0]["ranks"][2:]  # (the dense core starts at its own r_max)
    same = run_workers(moe_workers.train, 4, (4, 1), 2, BASE, 8)
    for r, s in zip(out, same, strict=True):
        assert r["expert_stats"].bytes_sent < s["expert_stats"].bytes_sent  # (rank 2 in int8 against 4 in float32)
        assert r["stats"].bytes_sent == s["stats"].bytes_sent and r["ranks"] == s["ranks"]


def test_expert_settings_without_an_expert_mesh_are_refused():
    out = run_workers(moe_workers.refuse_expert_config_alone, 2)
    assert all("expert_config but no expert_mesh" in r for r in out), out


def test_ddp_with_split_experts_is_refused_naming_the_route():
    out = run_workers(moe_workers.refuse_ddp, 2)
    assert all("expert_mesh" in r and "FSDP2" in r and r.startswith("ValueError") for r in out), out


def _train(data_dir, out, *extra):
    assert main([*train_args(data_dir, out, "--preset", "tiny-moe", "--nproc", "4"), *extra]) == 0
    return read_metrics(out / "metrics.jsonl")


def _col(records, key, kind="train"):
    return [r[key] for r in records if r["kind"] == kind]


def test_edgc_train_ep2_gives_ep1_losses_uncompressed(tmp_path, data_dir):
    steps = ["--method", "none", "--steps", "4", "--eval-every", "4"]
    one = _train(data_dir, tmp_path / "ep1", *steps)
    two = _train(data_dir, tmp_path / "ep2", *steps, "--ep", "2")
    sharded = _train(data_dir, tmp_path / "shards", *steps, "--ep", "2", "--dp-shard", "2")  # (2 replicas x 2 shards)
    # (equal but for the order of float sums: FSDP's against DDP's, the experts' over two groups;
    # Adam's normalisation makes that ~1e-5 of the loss after 4 steps)
    for run in (two, sharded):
        assert _col(run, "loss") == pytest.approx(_col(one, "loss"), rel=1e-4)
        assert _col(run, "val_loss", "val") == pytest.approx(_col(one, "val_loss", "val"), rel=1e-4)
    a = torch.load(tmp_path / "ep1" / CHECKPOINT_NAME, weights_only=False)["model"]
    b = torch.load(tmp_path / "ep2" / CHECKPOINT_NAME, weights_only=False)["model"]
    assert a.keys() == b.keys() and b["h.0.mlp.experts.w_fc"].shape[0] == 8  # (all experts, as one process holds them)
    # (Adam moves a row whose gradient is ~0 by up to lr a step on float noise alone; an
    # expert out of place would differ by the weights' scale, 0.02)
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=0, atol=2e-3), name
    assert all(r["expert_bytes"] > 0 and r["a2a_bytes"] > 0 for r in two if r["kind"] == "train")


def test_edgc_train_ep2_compresses_both_groups_and_resumes_exactly(tmp_path, data_dir):
    common = ["--method", "edgc", "--ep", "2", "--steps", "8", "--eval-every", "4", "--checkpoint-every", "4",
              "--edgc-warmup-steps", "2", "--edgc-window", "2", "--edgc-iteration-sample-rate", "1.0",
              "--edgc-max-rank", "4", "--edgc-min-rank", "2", "--edgc-warmup", "fixed"]
    straight = _train(data_dir, tmp_path / "straight", *common)
    none = _train(data_dir, tmp_path / "none", "--method", "none", "--ep", "2", "--steps", "8", "--eval-every", "4")
    assert sum(_col(straight, "bytes_sent")) < sum(_col(none, "bytes_sent"))
    train = [r for r in straight if r["kind"] == "train"]
    for r in train[2:]:
        assert r["rank"] > 0 and r["expert_rank"] > 0
        assert r["expert_bytes"] + r["dense_bytes"] == r["bytes_sent"] < r["bytes_uncompressed"]
        assert sum(r["expert_tokens"]) == 4 * 4 * 32 * 2 * 4  # workers x sequences x tokens x top-k x blocks
        assert 1 / 8 <= r["busiest_expert_share"] <= 1
    part = tmp_path / "part"
    _train(data_dir, part, *common, "--stop-after", "5")
    assert main(["train", "--resume", str(part), "--stop-after", "8", "--no-progress"]) == 0
    key = ("step", "loss", "val_loss", "rank", "expert_rank", "bytes_sent", "expert_tokens", "a2a_bytes")
    assert [tuple(r.get(k) for k in key) for r in straight] == \
        [tuple(r.get(k) for k in key) for r in read_metrics(part / "metrics.jsonl")]
    ca = torch.load(tmp_path / "straight" / CHECKPOINT_NAME, weights_only=False)
    cb = torch.load(part / CHECKPOINT_NAME, weights_only=False)
    assert_same(ca["model"], cb["model"], "model")
    assert "Experts:" in (tmp_path / "straight" / "summary.md").read_text()


def test_edgc_train_without_ep_compresses_each_expert_as_a_matrix_under_ddp(tmp_path, data_dir):
    # (a stacked [8, 256, 128] weight viewed as one 8 x 32768 matrix would not shrink at any rank)
    records = _train(data_dir, tmp_path / "ddp", "--method", "edgc", "--steps", "6", "--eval-every", "6",
                     "--edgc-warmup-steps", "2", "--edgc-warmup", "fixed", "--edgc-max-rank", "4")
    train = [r for r in records if r["kind"] == "train"]
    assert all("expert_bytes" not in r and r["a2a_bytes"] == 0 for r in train)  # (one core; no all-to-all)
    assert all(r["bytes_sent"] < 0.2 * r["bytes_uncompressed"] for r in train[2:])


def test_edgc_train_sends_the_experts_whole_with_settings_of_their_own(tmp_path, data_dir):
    # the experts' warm-up never ends and they travel in their own dtype: every expert byte
    # is the uncompressed one, while the dense gradients are compressed after step 2
    experts = ["--expert-edgc-warmup", "fixed", "--expert-edgc-warmup-steps", "1000000000",
               "--expert-edgc-wire", "native"]
    common = ["--method", "edgc", "--ep", "2", "--steps", "6", "--eval-every", "6", "--edgc-warmup", "fixed",
              "--edgc-warmup-steps", "2", "--edgc-max-rank", "4"]
    records = _train(data_dir, tmp_path / "run", *common, *experts)
    train = [r for r in records if r["kind"] == "train"]
    assert all(r["expert_rank"] == 0 and r["expert_bytes"] == train[0]["expert_bytes"] for r in train)
    assert all(r["rank"] == 4 and r["dense_bytes"] < train[0]["dense_bytes"] / 2 for r in train[2:])
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["expert_edgc"]["wire"] == "native" and saved["edgc"]["wire"] == "int8"
    assert saved["expert_edgc"]["max_rank"] == 4  # (not given: the run's)


def test_the_int8_all_to_all_sends_a_quarter_of_the_bytes_and_trains_alike(tmp_path, data_dir):
    steps = ["--method", "none", "--ep", "2", "--steps", "4", "--eval-every", "4"]
    native = _train(data_dir, tmp_path / "native", *steps)
    int8 = _train(data_dir, tmp_path / "int8", *steps, "--ep-wire", "int8")
    a, b = sum(_col(native, "a2a_bytes")), sum(_col(int8, "a2a_bytes"))
    # a row of 128 float32 values (512 bytes) against 128 codes and 4 bfloat16 scales (136),
    # besides the count exchange, the same in both
    assert b / a == pytest.approx(136 / 512, rel=0.02)
    assert _col(int8, "loss") == pytest.approx(_col(native, "loss"), rel=2e-3)


def test_edgc_train_ep2_keeps_every_replica_bit_identical(tmp_path, data_dir):
    from edgc.train.launch import run_local
    from edgc.train.trainer import prepare_run, train_worker

    values = dict(data=str(data_dir), out=str(tmp_path / "run"), nproc=4, batch_size=4, block_size=32,
                  eval_tokens=256, progress=False, rank=4, steps=8, eval_every=8, preset="tiny-moe", ep=2,
                  edgc={"warmup_steps": 2, "warmup": "fixed", "window": 2, "iteration_sample_rate": 1.0,
                        "min_rank": 2})
    from edgc.train.config import TrainConfig

    cfg = prepare_run(TrainConfig.from_dict(values), None, 4)
    out = run_local(train_worker, 4, cfg.to_dict(), str(data_dir), None, timeout=300, threads=1)
    assert len({r["dense_digest"] for r in out}) == 1  # every replica of the dense parameters
    # the experts: ranks 0 and 2 hold experts 0-3, ranks 1 and 3 experts 4-7
    assert out[0]["expert_digest"] == out[2]["expert_digest"] != out[1]["expert_digest"] == out[3]["expert_digest"]
    assert all(r["stats"].compressed_steps == 6 for r in out)
