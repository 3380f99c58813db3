"""benchmarks/state_memory.py, run as its docstring says: edgc's state per compressed
element, measured from outside the library, is at most 1.1x torch's powerSGD_hook's at the
same rank, with float32 and with bf16 gradients, and stats().state_bytes says the same."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_the_default_state_is_no_larger_than_torch_s_hook_s():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "state_memory.py"), "--layers", "3",
                           "--width", "96", "--rank", "4", "--steps", "3", "--state-dtype", "native,float32"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    rows = {}
    for line in done.stdout.splitlines():
        if re.match(r"\| (float32|bf16) \|", line):
            cells = [c.strip() for c in line.split("|")[1:-1]]
            rows[(cells[0], cells[1])] = [float(cells[2]), float(cells[3]), float(cells[5])]
    assert set(rows) == {(d, s) for d in ("float32", "bf16") for s in ("native", "float32")}
    for (dtype, state), (ours, torchs, reported) in rows.items():
        assert reported == ours  # stats().state_bytes: what the state holds
        if state == "native":
            assert ours <= 1.1 * torchs, (dtype, ours, torchs)
    # float32 error feedback for bf16 gradients: twice the default's error buffer
    assert rows[("bf16", "float32")][0] > 1.9 * rows[("bf16", "native")][0]
