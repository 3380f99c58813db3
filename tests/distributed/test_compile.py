"""The hook under torch.compile: a compiled model's gradients reach the hook as an eager
model's do (several gloo processes), and `edgc train --compile` trains, resumes exactly
and writes the same checkpoint keys as an eager run."""

import json
import math
import os

import pytest
import torch

import workers
from edgc.train.checkpoint import CHECKPOINT_NAME
from edgc.train.metrics import read_metrics
from harness import run_edgc, run_workers, train_args

CONFIG = dict(policy="cqm", max_rank=8, min_rank=2, rank_step=2, window=4, warmup_steps=4,
              iteration_sample_rate=1.0, warmup="fixed", min_compression_rate=1.0)


@pytest.mark.parametrize("how", [pytest.param("module", marks=pytest.mark.smoke), "ddp"])
def test_hook_compresses_a_compiled_model_as_an_eager_one(how):
    steps = 16
    eager = run_workers(workers.train_compiled, 2, CONFIG, steps, "eager", timeout=240)
    compiled = run_workers(workers.train_compiled, 2, CONFIG, steps, how, timeout=240)
    first = compiled[0]
    assert first["graphs"] >= 1, "nothing was compiled"
    assert first["buckets"] >= 3
    assert torch.equal(first["params"], compiled[1]["params"])  # replicas bit-identical
    assert first["ranks"] == eager[0]["ranks"] and max(first["ranks"]) > 0  # compressed, at the same ranks
    stats = first["stats"]
    assert stats.compressed_steps == steps - 4 and 0 < stats.bytes_sent < stats.bytes_uncompressed
    assert stats.bytes_sent == eager[0]["stats"].bytes_sent
    # the same training, up to the float rounding of the compiled graphs
    torch.testing.assert_close(first["losses"], eager[0]["losses"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(first["params"], eager[0]["params"], rtol=1e-3, atol=1e-4)


def _edgc(args, cwd, env):
    proc = run_edgc(*args, cwd=cwd, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr


def _tensor_paths(obj, path=""):
    """The paths of every tensor in a checkpoint's nested dicts and lists."""
    if isinstance(obj, torch.Tensor):
        return {path}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    return set().union(*(_tensor_paths(v, f"{path}/{k}") for k, v in items))


def _records(run):
    return [(r["step"], r.get("loss"), r.get("val_loss"), r.get("rank"), r.get("bytes_sent"))
            for r in read_metrics(run / "metrics.jsonl") if r["kind"] in ("train", "val")]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [[], ["--dp-shard", "1", "--dp-replicate", "2"], ["--pp", "2"]],
                         ids=["ddp", "hsdp", "pipeline"])
def test_train_compile_through_the_cli_matches_eager_and_resumes_exactly(tmp_path, data_dir, layout):
    cache = tmp_path / "inductor"
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache))
    common = ["--method", "edgc", "--steps", "6", "--eval-every", "3", "--checkpoint-every", "3",
              "--edgc-warmup-steps", "2", "--edgc-window", "2", "--device", "cpu", *layout]
    eager, straight, part = tmp_path / "eager", tmp_path / "straight", tmp_path / "part"
    _edgc(train_args(data_dir, eager, *common), tmp_path, env)
    assert not any(cache.rglob("*.py"))  # (nothing compiles without --compile)
    _edgc(train_args(data_dir, straight, *common, "--compile"), tmp_path, env)
    assert json.loads((straight / "config.json").read_text())["compile"] is True
    assert any(cache.rglob("*.py")), "inductor wrote no code: nothing was compiled"
    _edgc(train_args(data_dir, part, *common, "--compile", "--stop-after", "3"), tmp_path, env)
    _edgc(["train", "--resume", str(part), "--stop-after", "6", "--no-progress"], tmp_path, env)
    a, b, e = _records(straight), _records(part), _records(eager)
    assert a == b  # a compiled run resumed equals one straight through, bit for bit
    assert [r[0] for r in a] == [r[0] for r in e] and [r[3:] for r in a] == [r[3:] for r in e]  # ranks, bytes
    for x, y in zip(a, e, strict=True):  # the losses of the eager run, up to float rounding
        for u, v in zip(x[1:3], y[1:3], strict=True):
            assert (u is None) == (v is None) and (u is None or math.isclose(u, v, rel_tol=1e-3)), (x, y)
    # the checkpoint is an eager run's: the same keys, no "_orig_mod." prefix
    saved, plain = (torch.load(d / CHECKPOINT_NAME, weights_only=False) for d in (straight, eager))
    assert _tensor_paths(saved) == _tensor_paths(plain)
    # and a compiled run's checkpoint resumes eagerly (compile may change on resume)
    _edgc(["train", "--resume", str(part), "--steps", "8", "--stop-after", "8", "--no-compile", "--no-progress"],
          tmp_path, env)
    assert json.loads((part / "config.json").read_text())["compile"] is False
    assert _records(part)[-1][0] == 8
