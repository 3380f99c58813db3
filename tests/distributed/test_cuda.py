"""The CUDA path: run where a GPU is present (marked `cuda`; skipped without one, as in CI).

Two processes share one GPU over gloo (which carries CUDA tensors); NCCL, which needs a GPU
per process, is used when there are two. The tests through `edgc train` need the `train`
extra (its tokenizers); without it they are skipped with a reason that names it, which
scripts/gpu-check.sh accepts, so that on a machine with torch alone the hook's CUDA path is
still checked.
"""

import json
import math
import subprocess
import sys

import pytest
import torch

import workers
from edgc.extras import missing_modules
from harness import run_workers

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

#: the tests through `edgc train`, which tokenizes its corpus
needs_train_extra = pytest.mark.skipif(
    bool(missing_modules("train")),
    reason=f"needs the train extra (pip install 'edgc[train]'; missing: {', '.join(missing_modules('train'))})")


@pytest.mark.parametrize("mode", ["pipelined", "whole-step"])
def test_hook_on_cuda_bf16_replicas_identical_and_timed(mode):
    cfg = dict(policy="cqm", max_rank=4, min_rank=2, rank_step=2, window=3, warmup_steps=2,
               iteration_sample_rate=1.0, min_compression_rate=1.0, sync_mode=mode)
    results = run_workers(workers.train_mixed_dtypes_cuda, 2, cfg, 12, timeout=300)
    a, b = results
    assert torch.equal(a["params"], b["params"])
    assert a["stats"].compressed_steps == 10 and a["stats"].nonfinite_steps == 0
    assert a["stats"].comm_seconds > 0 and math.isfinite(a["stats"].compress_seconds)


@needs_train_extra
def test_edgc_train_on_cuda_with_bf16(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "edgc", "train", "--device", "cuda", "--dtype", "bf16", "--nproc", "2",
           "--steps", "20", "--out", str(out), "--no-progress", "--corpus-bytes", "400000",
           "--data-cache", str(tmp_path / "cache"), "--edgc-warmup-steps", "5"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = json.loads((out / "config.json").read_text())
    assert (saved["device"], saved["dtype"]) == ("cuda", "bf16")
    train = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in train if r["kind"] == "train"]
    assert train[-1]["phase"] == "compress" and all(math.isfinite(r["loss"]) for r in train)


@needs_train_extra
@pytest.mark.parametrize("method", ["none", "edgc"])
def test_hsdp_through_the_cli_on_cuda_with_bf16(tmp_path, method):
    # one GPU: a 1 x 1 mesh over NCCL, so FSDP2, the hook's streams and the eager core run on
    # CUDA; with 4 GPUs, 2 replicas x 2 shards (NCCL, a GPU each)
    layout = ["2", "2"] if torch.cuda.device_count() >= 4 else ["1", "1"]
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "edgc", "train", "--device", "cuda", "--dtype", "bf16", "--method", method,
           "--dp-replicate", layout[0], "--dp-shard", layout[1], "--steps", "12", "--checkpoint-every", "6",
           "--out", str(out), "--no-progress", "--corpus-bytes", "400000", "--data-cache", str(tmp_path / "cache"),
           "--edgc-warmup-steps", "4", "--edgc-window", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert all(math.isfinite(r["loss"]) for r in train)
    if method == "edgc":
        assert train[-1]["phase"] == "compress"
    assert any(r["kind"] == "memory" and r["peak_mb"] > 0 for r in records)


@needs_train_extra
def test_experts_through_the_cli_on_cuda_with_bf16(tmp_path):
    # two workers, experts split over both: over NCCL with a GPU each, else gloo carrying CUDA
    # tensors on one shared GPU (its all-to-all included)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "edgc", "train", "--device", "cuda", "--dtype", "bf16", "--preset", "tiny-moe",
           "--ep", "2", "--nproc", "2", "--steps", "12", "--checkpoint-every", "6", "--out", str(out),
           "--no-progress", "--corpus-bytes", "400000", "--data-cache", str(tmp_path / "cache"),
           "--edgc-warmup-steps", "4", "--edgc-window", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert all(math.isfinite(r["loss"]) for r in train) and train[-1]["phase"] == "compress"
    assert all(r["a2a_bytes"] > 0 and sum(r["expert_tokens"]) > 0 for r in train)
