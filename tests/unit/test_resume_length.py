"""A resume that changes --steps continues the run; it does not turn it into the run the new
--steps gives from the start. `edgc train` says so once, on stderr, with the learning rate
the next step runs at, and what stays as the first length set it."""

import dataclasses
import logging
import subprocess
import sys

from edgc.train.checkpoint import save_checkpoint
from edgc.train.config import TrainConfig
from edgc.train.trainer import lr_at, resume_config


def _saved_run(tmp_path, step: int, **options) -> TrainConfig:
    """A checkpoint at `step` of a run of `options` in tmp_path/run (settings only: what
    resume_config reads); returns the run's resolved settings."""
    cfg = TrainConfig(out=str(tmp_path / "run"), **options).resolve()
    save_checkpoint(tmp_path / "run" / "checkpoint.pt", {"step": step, "train": cfg.to_dict()})
    return cfg


def test_a_resume_with_more_steps_warns_once_that_the_schedule_is_recomputed(tmp_path):
    ran = _saved_run(tmp_path, 300, steps=300)
    # (no data there: the command stops after the settings, before any worker starts)
    proc = subprocess.run([sys.executable, "-m", "edgc", "train", "--resume", "run", "--steps", "600", "--data",
                           "nowhere"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no prepared data there" in proc.stderr
    longer = dataclasses.replace(ran, steps=600)
    expected = (f"resuming with --steps 600 (the run's: 300): the cosine learning rate is recomputed over 600 "
                f"steps, so step 301 runs at {lr_at(301, longer):.2e} where step 300 ran at {lr_at(300, ran):.2e}; "
                f"these stay as the 300-step run set them: the learning rate's warm-up (15 steps), the "
                f"compression's window (20 steps), its warm-up (warmup_steps 30)")
    assert proc.stderr.count(expected) == 1, proc.stderr
    assert f"{lr_at(301, longer):.2e}" == "5.66e-04" and f"{lr_at(300, ran):.2e}" == "1.00e-04"


def test_the_warning_names_the_step_schedule_and_only_a_changed_length(tmp_path, caplog):
    _saved_run(tmp_path, 100, steps=300, method="none", lr_schedule="step", lr_drop_steps="150,250")
    checkpoint = tmp_path / "run" / "checkpoint.pt"
    with caplog.at_level(logging.WARNING, logger="edgc.train.trainer"):
        resume_config(checkpoint, {"stop_after": 200})
        assert "recomputed" not in caplog.text and "stay as" not in caplog.text
        assert resume_config(checkpoint, {"steps": 400}).steps == 400
    assert ('the "step" schedule\'s drops stay at steps 150,250; these stay as the 300-step run set them: the '
            "learning rate's warm-up (15 steps). This continues the run") in caplog.text
