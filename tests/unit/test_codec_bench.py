"""benchmarks/codec_speed.py, run as its docstring says: one row per dtype and operation,
each with a time, a throughput and (the codec's rows) its ratio to the cast."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "codec_speed.py"), *args], capture_output=True,
                          text=True, env=env, timeout=120)


def test_codec_benchmark_reports_every_operation_beside_the_cast():
    done = _run("--numel", "1000", "--repeats", "2", "--dtype", "float32,bfloat16", "--threads", "1")
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if re.match(r"\| (float32|bfloat16) \|", line)]
    ops = ["quantize", "dequantize", "2-sum", "cast to bf16", "cast from bf16"]
    assert [r.split("|")[1:3] for r in rows] == [[f" {d} ", f" {op} "] for d in ("float32", "bfloat16") for op in ops]
    for row in rows:
        cells = [c.strip() for c in row.split("|")[3:-1]]
        assert float(cells[0]) > 0 and float(cells[1]) > 0  # ms, GB/s
        assert (cells[2] == "") == row.split("|")[2].strip().startswith("cast")  # a ratio on the codec's rows
        if cells[2]:
            assert float(cells[2].rstrip("x")) > 0


def test_codec_benchmark_refuses_bad_options():
    done = _run("--dtype", "float8")
    assert done.returncode == 2 and "--dtype 'float8'" in done.stderr
    assert _run("--numel", "0").returncode == 2


def test_codec_benchmark_times_another_version_of_the_codec_beside_it():
    done = _run("--numel", "300", "--repeats", "1", "--dtype", "float32", "--against",
                str(ROOT / "src" / "edgc" / "comm" / "wire.py"))
    assert done.returncode == 0, done.stderr
    for op in ("quantize", "dequantize", "2-sum"):
        assert f"| float32 | wire.py: {op} |" in done.stdout, done.stdout
