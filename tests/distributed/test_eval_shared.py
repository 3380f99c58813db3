"""Evaluation shared out over data-parallel ranks gives what one process computes."""

import math

import numpy as np
import torch

import workers
from edgc.data import TokenFile, write_token_file
from edgc.models import build_model
from edgc.train.config import TrainConfig
from edgc.train.trainer import evaluate
from harness import run_workers


def test_shared_evaluation_equals_one_process(tmp_path):
    ids = np.random.default_rng(1).integers(0, 64, size=32 * 23 + 1)  # 23 blocks: uneven over 2 ranks
    write_token_file([ids], tmp_path / "val.bin", vocab_size=64, tokenizer_name="test")
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=64, block_size=32)
    alone = evaluate(model, TokenFile(tmp_path / "val.bin"), TrainConfig(block_size=32, batch_size=4, eval_tokens=None),
                     0, 1, torch.device("cpu"))
    results = run_workers(workers.evaluate_shared, 2, str(tmp_path / "val.bin"), None)
    assert results[0] == results[1]  # every rank reports the same figures
    assert results[0]["blocks"] == alone.blocks == 23
    # (the sums are added in another order: equal to rounding)
    assert math.isclose(results[0]["loss"], alone.loss, rel_tol=1e-12)
    assert math.isclose(results[0]["se"], alone.se, rel_tol=1e-9)
