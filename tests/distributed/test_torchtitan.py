"""edgc inside torchtitan, through torchtitan's own entry point (`torchrun -m torchtitan.train
--module edgc.integrations.torchtitan --config llama3_debugmodel`), on 4 gloo processes with
the CPU shim (titan_shim.py), on the built-in corpus.

Each run writes what the tests read back (titan_shim.record): the logged losses, edgc's
stats, each process's coordinates and a digest of its parameter shards."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan", reason="the torchtitan extra (Python 3.11+)")

from titan_shim import CPU_FLAGS

pytestmark = pytest.mark.slow

SHIM = Path(__file__).parent / "titan_shim.py"
#: a small debug run: 2 replicas x 2 shards, 2 sequences of 128 tokens a process and step
SMALL = ["--training.seq-len", "128", "--training.local-batch-size", "2", "--metrics.disable-color-printing",
         "--parallelism.data-parallel-replicate-degree", "2", "--debug.seed", "0"]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A working directory whose runs/.data holds the built-in corpus, prepared once
    (what the offline defaults read), shared by this module's runs."""
    from edgc.data import builtin_folder, ensure_builtin

    path = tmp_path_factory.mktemp("titan")
    ensure_builtin(path / builtin_folder("runs/.data"))  # (BUILTIN_DATA, without importing torchtitan here)
    return path


def titan(home: Path, out: Path, *flags: str, nproc: int = 4, config: str = "llama3_debugmodel") -> list[dict]:
    """Run torchtitan's trainer with edgc (`flags` after the CPU's and SMALL) and return
    each process's record, in rank order; fails with the run's output if it fails."""
    record = out / "record"
    shutil.rmtree(record, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), str(SHIM),
           "--module", "edgc.integrations.torchtitan", "--config", config, *CPU_FLAGS, *SMALL,
           "--dump-folder", str(out), *flags]
    env = {**os.environ, "EDGC_TITAN_RECORD": str(record), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=home, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        pytest.fail(f"torchtitan run failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}")
    return [json.loads((record / f"rank{r}.json").read_text()) for r in range(nproc)]


def losses(records: list[dict]) -> list[float]:
    """The logged losses, step by step (every process logs the same global loss)."""
    got = records[0]["losses"]
    return [got[k] for k in sorted(got, key=int)]


def assert_replicas_identical(records: list[dict]) -> None:
    """Processes at the same shard and TP coordinates (replicas of one shard) hold
    bit-identical parameters, and the run had at least 2 replicas."""
    by_shard: dict[tuple, set[str]] = {}
    for r in records:
        by_shard.setdefault((r["coords"]["fsdp"], r["coords"]["tp"]), set()).add(r["digest"])
    assert all(len(digests) == 1 for digests in by_shard.values()), by_shard
    assert len({r["coords"]["dp_replicate"] for r in records}) >= 2


def test_hsdp_warm_up_equals_native_then_compresses_with_replicas_identical(home, tmp_path):
    """2 replicas x 2 shards: with the gradient's dtype on the wire, the warm-up's losses
    equal native HSDP's bit for bit (so the sum over replicas is torchtitan's); the steps
    after it are compressed, send fewer bytes, and the replicas stay identical."""
    steps = 20  # (the same in both: the learning rate's schedule follows it)
    native = titan(home, tmp_path / "native", "--training.steps", str(steps), "--edgc.no-enable")
    assert all(r["edgc"] is None for r in native)
    edgc = titan(home, tmp_path / "edgc", "--training.steps", str(steps), "--edgc.wire", "native",
                 "--edgc.warmup", "fixed", "--edgc.warmup-steps", "5", "--edgc.min-compression-rate", "1")
    # (a step's loss comes before its sync: the 6th is the last that the warm-up alone made)
    assert losses(edgc)[:6] == losses(native)[:6]
    assert losses(edgc)[6:] != losses(native)[6:]
    for r in edgc:
        stats = r["edgc"]
        assert stats["step"] == steps and stats["compressed_steps"] == steps - 5, stats
        assert 0 < stats["bytes_sent"] < stats["bytes_uncompressed"] and stats["nonfinite_steps"] == 0
    assert_replicas_identical(edgc)


def test_a_resume_from_torchtitans_checkpoint_equals_the_uninterrupted_run(home, tmp_path):
    """edgc's defaults (int8 wire, a warm-up the gradient ends, the window scaled to the
    run): a run that checkpoints at step 10 through torchtitan's DCP checkpointer, and a
    second run started from that checkpoint, end bit for bit as the uninterrupted run,
    with the same edgc stats; TensorBoard gets edgc's metrics."""
    flags = ["--training.steps", "20", "--checkpoint.enable", "--checkpoint.interval", "10",
             "--metrics.enable-tensorboard"]
    whole = titan(home, tmp_path / "whole", *flags)
    assert whole[0]["edgc"]["compressed_steps"] > 5
    resumed_out = tmp_path / "resumed"
    (resumed_out / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "whole" / "checkpoint" / "step-10", resumed_out / "checkpoint" / "step-10")
    resumed = titan(home, resumed_out, *flags)
    assert sorted(resumed[0]["losses"], key=int)[0] == "11"  # (it started from step 10's checkpoint)
    assert losses(resumed) == losses(whole)[10:]
    for a, b in zip(whole, resumed, strict=True):
        assert a["digest"] == b["digest"]
        untimed = {k: v for k, v in a["edgc"].items() if not k.endswith("_seconds")}
        assert untimed == {k: v for k, v in b["edgc"].items() if not k.endswith("_seconds")}
    assert_replicas_identical(whole)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = next((tmp_path / "whole" / "tb").rglob("events.out.tfevents.*"))
    tags = EventAccumulator(str(events)).Reload().Tags()["scalars"]
    assert {"edgc/rank", "edgc/compression_ratio", "edgc/bytes_sent"} <= set(tags), tags


def test_tensor_parallel_with_replicas_compresses_each_tp_shard(home, tmp_path):
    """TP 2 x replicate 2: each TP rank's shards are compressed over its own replicas,
    the rank agreed across TP ranks; replicas identical."""
    records = titan(home, tmp_path / "tp", "--training.steps", "12", "--parallelism.tensor-parallel-degree", "2")
    assert {r["coords"]["tp"] for r in records} == {0, 1}
    ranks = {r["edgc"]["step_rank"] for r in records}
    assert len(ranks) == 1 and ranks.pop() > 0
    assert all(r["edgc"]["compressed_steps"] > 0 for r in records)
    assert_replicas_identical(records)


def test_gradient_accumulation_syncs_once_per_optimiser_step(home, tmp_path):
    """Two micro-batches a step (global batch 2 x 2 x 4 processes): one compressed sync
    per optimiser step, not one per micro-batch, and the replicas stay identical."""
    steps = 10
    records = titan(home, tmp_path / "accum", "--training.steps", str(steps), "--training.global-batch-size", "16")
    for r in records:
        assert r["edgc"]["step"] == steps and r["edgc"]["compressed_steps"] > 0, r["edgc"]
    assert_replicas_identical(records)
