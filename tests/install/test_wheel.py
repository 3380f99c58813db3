"""The package as a user installs it: a wheel built from this checkout, in a fresh venv.

Slow (a venv, torch and the dependencies installed into it, then a real training run):
run with --runslow, as CI does.
"""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCH = os.environ.get("EDGC_TORCH", "torch==2.13.0")  # the pin of scripts/setup.sh


def _run(args: list, cwd: Path, timeout: float = 900) -> str:
    """Run a command, fail the test with its output when it fails; returns its stdout."""
    done = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    """`python -m build` on a copy of the checkout's package files: (wheel, sdist)."""
    tmp = tmp_path_factory.mktemp("build")
    source = tmp / "source"
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    # (--no-isolation: the build backend from this venv, so that building needs no download)
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", tmp / "dist", source], cwd=tmp)
    wheels = list((tmp / "dist").glob("edgc-*.whl"))
    sdists = list((tmp / "dist").glob("edgc-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, list((tmp / "dist").iterdir())
    return wheels[0], sdists[0]


@pytest.mark.slow
def test_the_wheel_carries_the_version_the_type_marker_and_the_cluster_files(built):
    import edgc

    wheel, sdist = built
    assert wheel.name.startswith(f"edgc-{edgc.__version__}-") and sdist.name == f"edgc-{edgc.__version__}.tar.gz"
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "edgc/py.typed" in names
    assert {"edgc/bench/clusters/paper-2.5b.toml", "edgc/bench/clusters/paper-12.1b.toml"} <= names
    assert "edgc/cli.py" in names and not any(n.startswith("tests/") for n in names)


@pytest.mark.slow
def test_the_wheel_installs_in_a_fresh_venv_and_its_commands_run(built, tmp_path):
    wheel, _ = built
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], cwd=tmp_path)
    py, edgc = venv / "bin" / "python", venv / "bin" / "edgc"
    _run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", TORCH], cwd=tmp_path)
    _run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", wheel], cwd=tmp_path)

    # A working folder away from the checkout, so that nothing is imported from it.
    work = tmp_path / "work"
    work.mkdir()
    where = _run([py, "-c", "import edgc; print(edgc.__file__); print(edgc.__version__)"], cwd=work).split()
    assert Path(where[0]).is_relative_to(venv), where
    import edgc as here

    assert where[1] == here.__version__
    assert _run([edgc, "--version"], cwd=work).strip() == f"edgc {here.__version__}"
    assert "train" in _run([edgc, "--help"], cwd=work)

    out = _run([edgc, "train", "--steps", "5"], cwd=work)  # (its run folder: runs/edgc)
    run = work / "runs" / "edgc"
    assert "run folder:" in out
    for name in ("config.json", "metrics.jsonl", "summary.md", "checkpoint.pt"):
        assert (run / name).is_file(), name
