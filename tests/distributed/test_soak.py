"""The race soak (`edgc bench soak`): many buckets, a changing rank, 4 workers, run after
run; no run may hang, abort or end with replicas that differ.

    pytest tests/distributed/test_soak.py --runslow --soak-runs 50    # the issue's 50 runs
"""

import re

import pytest

from edgc.cli import main


def _soak(capsys, runs, steps, mode="pipelined", extra=()):
    code = main(["bench", "soak", "--runs", str(runs), "--nproc", "4", "--bucket-cap-mb", "0.05",
                 "--steps", str(steps), "--sync-mode", mode, "--timeout", "600", *extra])
    out = capsys.readouterr().out
    row = re.search(r"^\| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \|$", out, re.M)
    assert row, out
    runs_, ok, hangs, aborts, mismatches, unchanged = map(int, row.groups())
    assert (runs_, hangs, aborts, mismatches) == (runs, 0, 0, 0), out
    assert ok == runs and code == 0, out
    assert unchanged == 0, f"the rank never changed in {unchanged} runs:\n{out}"
    assert int(re.search(r"\((\d+) buckets\)", out).group(1)) >= 10, out


def test_quick_soak_pipelined(capsys):
    _soak(capsys, runs=2, steps=10, extra=["--block", "32", "--batch", "2"])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pipelined", "whole-step"])
def test_soak(capsys, request, mode):
    runs = request.config.getoption("--soak-runs")
    _soak(capsys, runs=runs if mode == "pipelined" else max(1, runs // 5), steps=20, mode=mode)
