"""`edgc train --resume` loads only tensors and plain values: what a run saves resumes as it
is, a checkpoint that names another Python object is refused in one line, and
`--trust-checkpoint`, given each time, resumes one that the user trusts."""

import datetime
import os
import shlex

import torch

from edgc.train.checkpoint import CHECKPOINT_NAME, load_checkpoint
from harness import run_edgc, train_args


class _Touch:
    """Unpickled, it would run a shell command that creates `marker`."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def _refusal(proc, run, held: str) -> str:
    """The one line a refused resume printed; checks it names the checkpoint and `held`."""
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgc train: error: checkpoint "), proc.stderr
    assert str(run / CHECKPOINT_NAME) in lines[0] and f"it holds {held}" in lines[0], lines[0]
    return lines[0]


def test_a_run_resumes_its_own_checkpoint_and_only_a_trusted_one_that_holds_more(tmp_path, data_dir):
    run, marker = tmp_path / "run", tmp_path / "ran"
    proc = run_edgc(*train_args(data_dir, run, "--method", "edgc", "--steps", "2", "--stop-after", "1",
                                "--eval-every", "2", "--edgc-warmup-steps", "1"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    saved = torch.load(run / CHECKPOINT_NAME, weights_only=True)  # (what edgc saves: no code needed)
    assert saved["step"] == 1

    torch.save({**saved, "extra": _Touch(marker)}, run / CHECKPOINT_NAME)
    for flags in ([], ["--trust-checkpoint", "false"]):
        proc = run_edgc("train", "--resume", str(run), "--stop-after", "null", *flags, cwd=tmp_path)
        line = _refusal(proc, run, f"{os.system.__module__}.system")
        assert "edgc train --trust-checkpoint" in line
    assert not marker.exists()

    # a harmless object that is not a tensor nor a plain value: refused, then resumed on trust
    torch.save({**saved, "extra": datetime.date(2024, 1, 1)}, run / CHECKPOINT_NAME)
    _refusal(run_edgc("train", "--resume", str(run), "--stop-after", "null", cwd=tmp_path), run, "datetime.date")
    proc = run_edgc("train", "--resume", str(run), "--stop-after", "null", "--trust-checkpoint", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    resumed = load_checkpoint(run)  # (the run's new checkpoint loads without trust)
    assert resumed["step"] == 2 and "extra" not in resumed

    # the trust is not kept: the next resume of a checkpoint that holds more is refused again
    torch.save({**resumed, "extra": datetime.date(2024, 1, 1)}, run / CHECKPOINT_NAME)
    _refusal(run_edgc("train", "--resume", str(run), "--steps", "3", cwd=tmp_path), run, "datetime.date")
