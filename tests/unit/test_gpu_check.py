"""scripts/gpu-check.sh, the one command for a lent GPU, checked where there is none: it is
valid bash; without CUDA it stops in one line and writes nothing; every command it would
run parses with the options those commands have today (so that it cannot silently rot);
and its bookkeeping (time limits, logs, the README, the exit status) works, run against a
stand-in python that plays a GPU machine."""

import argparse
import datetime
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from edgc.cli import _given_options, build_parser
from edgc.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"
PARTS = ["round-cost-345m", "round-cost-2.5b", "cuda-tests", "ddp-nccl",  # (in the order they run)
         "ddp-shared-gpu", "hsdp-nccl", "torchtitan", "hook-vs-torch", "simulate-2.5b", "simulate-12.1b"]
#: the parts a machine of one GPU runs, and those of several
ONE_GPU = [p for p in PARTS if p != "torchtitan"]
SEVERAL = [p for p in PARTS if p != "ddp-shared-gpu"]


def _run(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """The script as a user runs it, with this python (and $OUT only when `env` sets it)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_") and k != "OUT"}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**base, "GPU_CHECK_PYTHON": sys.executable, **(env or {})})


def test_the_script_is_valid_bash_and_lists_its_parts():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    done = _run("--list")
    assert done.returncode == 0 and done.stdout.split() == PARTS


@pytest.mark.parametrize("args, message", [
    (["--only", "cuda-tests,nope"], "no part 'nope'"),
    (["--time-scale", "0"], "--time-scale must be a positive number"),
    (["--bogus"], "unknown option '--bogus'"),
])
def test_a_bad_option_is_refused_in_one_line(args, message):
    done = _run(*args)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"gpu-check: {message}"), done.stderr


def test_the_results_folder_is_named_after_the_gpus_model():
    names = {"NVIDIA H100 80GB HBM3": "h100", "NVIDIA H200": "h200", "NVIDIA A100-SXM4-80GB": "a100",
             "Tesla V100-SXM2-16GB": "v100", "NVIDIA GeForce RTX 4090": "rtx4090", "NVIDIA L40S": "l40s",
             "AMD Instinct MI300X": "mi300x", "": "gpu"}
    script = "; ".join(f"gpu_short_name {shlex.quote(name)}" for name in names)
    done = subprocess.run(["bash", "-c", f"source {shlex.quote(str(SCRIPT))}; {script}"], capture_output=True,
                          text=True, timeout=30)
    assert done.stdout.split() == list(names.values()), done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_without_cuda_it_stops_in_one_line_and_writes_nothing(tmp_path):
    results = sorted(p.name for p in (ROOT / "benchmarks" / "results").iterdir())
    for env in ({"OUT": str(tmp_path / "out")}, {}):
        done = _run(env=env)
        assert done.returncode == 2
        (line,) = done.stderr.strip().splitlines()
        assert line.startswith("gpu-check: no CUDA: torch ") and "nothing was run or written" in line
        assert f"python: {sys.executable}" in done.stdout  # it says which python it found
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in (ROOT / "benchmarks" / "results").iterdir()) == results


def _plan_lines(gpus: int) -> dict[str, str]:
    """--dry-run's lines, "NAME\tLIMIT\tCOMMAND", as on a machine with `gpus` GPUs, by name."""
    done = _run("--dry-run", env={"GPU_CHECK_GPUS": str(gpus)})
    assert done.returncode == 0, done.stderr
    return {line.split("\t")[0]: line for line in done.stdout.splitlines()}


def _plan(gpus: int) -> dict[str, list[str]]:
    """--dry-run's parts: {name: argv}."""
    plan = {}
    for name, line in _plan_lines(gpus).items():
        _, limit, command = line.split("\t")
        assert int(limit) > 0
        plan[name] = shlex.split(command)
    return plan


def test_docs_list_its_parts_and_their_limits():
    """docs/developing.md's table of the parts says what the script runs."""
    text = (ROOT / "docs" / "developing.md").read_text()
    section = text[text.index("## On a lent GPU"):text.index("## Lint and types")]
    documented = {}
    for names, limit in re.findall(r"^\| (`[^|]+) \|.*\| (\d+) s(?: each)? \|$", section, re.M):
        for name in re.findall(r"`([^`]+)`", names):
            documented[name] = int(limit)
    limits = {name: int(line.split("\t")[1]) for gpus in (1, 2) for name, line in _plan_lines(gpus).items()}
    assert documented == limits


def _benchmark_parser(name: str) -> argparse.ArgumentParser:
    """The argument parser of benchmarks/NAME.py."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser()


@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_every_command_it_runs_parses_with_todays_options(gpus, monkeypatch):
    plan = _plan(gpus)
    assert list(plan) == (ONE_GPU if gpus == 1 else SEVERAL)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (validate() asks for a GPU)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    for name, argv in plan.items():
        assert argv[0] == sys.executable, argv
        if argv[1:3] == ["-m", "edgc"]:
            args = build_parser().parse_args(argv[3:])  # an unknown flag or value exits here
            if args.command == "train":
                cfg = TrainConfig.from_dict(_given_options(args))
                assert (cfg.device, cfg.dtype, cfg.method) == ("cuda", "bf16", "edgc")
                resolved = cfg.resolve()
                resolved.validate()
                cfg.check_layout(resolved.nproc)
                # NCCL where the workers have a GPU each; the shared-GPU part is the gloo one
                backend = "gloo" if name == "ddp-shared-gpu" else "nccl"
                assert cfg.backend(resolved.nproc) == backend, name
                assert cfg.hsdp == name.startswith("hsdp")
            else:
                assert args.command == "simulate" and args.device == "cuda" and args.save_profile
        elif argv[1:3] == ["-m", "torch.distributed.run"]:  # (its config: tests/unit/test_torchtitan_config.py)
            assert name == "torchtitan" and argv[argv.index("--nproc-per-node") + 1] == str(gpus)
            assert argv[5:9] == ["-m", "torchtitan.train", "--module", "edgc.integrations.torchtitan"], argv
            assert argv[argv.index("--parallelism.data-parallel-replicate-degree") + 1] == "2"
        elif argv[1] == "benchmarks/hook_vs_torch.py":
            assert _benchmark_parser("hook_vs_torch").parse_args(argv[2:]).device == "cuda"
        elif argv[1] == "benchmarks/round_cost.py":
            args = _benchmark_parser("round_cost").parse_args(argv[2:])
            assert args.device == "cuda" and args.json and (args.preset, args.dtype) in {
                ("gpt2-345m", "float32"), ("gpt2-2.5b", "bf16")}, name
        else:
            assert argv[1:3] == ["-m", "pytest"] and name == "cuda-tests"


def test_its_pytest_selection_collects_the_cuda_tests(tmp_path):
    argv = _plan(1)["cuda-tests"]
    argv = [f"--junitxml={tmp_path / 'x.xml'}" if a.startswith("--junitxml=") else a for a in argv]
    done = subprocess.run([*argv, "--collect-only"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    collected = {line.split("[")[0] for line in done.stdout.splitlines() if "::" in line}
    assert collected == {
        "tests/distributed/test_cuda.py::test_hook_on_cuda_bf16_replicas_identical_and_timed",
        "tests/distributed/test_cuda.py::test_edgc_train_on_cuda_with_bf16",
        "tests/distributed/test_cuda.py::test_hsdp_through_the_cli_on_cuda_with_bf16",
        "tests/distributed/test_cuda.py::test_experts_through_the_cli_on_cuda_with_bf16",
        "tests/unit/test_step.py::test_no_host_sync_before_the_last_bucket_on_cuda",
    }


# A stand-in for python on a machine with one GPU: the probe says so, and each part's command
# does what the test asks of it.
FAKE_PYTHON = r"""#!/usr/bin/env bash
if [[ $1 == - ]]; then
    cat >/dev/null
    printf '%s\n' python=3.99.0 executable=/fake/python cpus=16 torch=9.9.9+cu999 cuda_build=99.9 \
        cuda_available=1 gpus=1 "gpu_name=NVIDIA X100 80GB HBM9" gpu_memory_gib=80 bf16=1 cudnn=99999 \
        nccl=9.9.9 edgc=0.0.0 missing= pytest=1
    exit 0
fi
case "$*" in # (by the command's start: the paths in it may say anything)
"-m pytest "*) echo "2 passed"; echo "SKIPPED [1] tests/unit/test_step.py:175: needs a CUDA GPU"
    echo "SKIPPED [2] tests/distributed/test_cuda.py:44: needs the train extra (pip install 'edgc[train]')"; exit 0 ;;
"benchmarks/hook_vs_torch.py "*) exec sleep 60 ;;
"-m edgc simulate --cluster paper-12.1b "*) echo "no such cluster" >&2; exit 3 ;;
"-m edgc simulate "*) for ((i = 1; i <= $#; i++)); do
        [[ ${!i} == --save-profile ]] && { j=$((i + 1)); echo "{}" >"${!j}"; }
    done
    echo "a projection" ;;
"-m edgc train "*) for ((i = 1; i <= $#; i++)); do
        [[ ${!i} == --out ]] && { j=$((i + 1)); mkdir -p "${!j}";
            printf 'run\n\n![loss](loss.png)\n' >"${!j}/summary.md";
            echo big >"${!j}/checkpoint.pt"; echo png >"${!j}/loss.png"; }
    done ;;
esac
exit 0
"""


def test_parts_are_timed_logged_and_reported_whatever_each_does(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    # scale 0.05: hook-vs-torch (90 s) gets 5 s before it is stopped, the budget 27 s
    done = _run("--time-scale", "0.05", env={"GPU_CHECK_PYTHON": str(fake), "OUT": str(tmp_path / "out")},
                timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    day = datetime.date.today().strftime("%Y%m%d")
    res = tmp_path / "out" / "benchmarks" / "results" / f"x100-{day}" / "gpu-check"
    # (a test skipped for want of the train extra is not counted: the torch-only ones ran)
    assert "not passed: cuda-tests (failed: 1 SKIPPED line(s) in its log" in done.stdout
    assert "hook-vs-torch (timed out after 5 s)" in done.stdout and "simulate-12.1b (failed)" in done.stdout
    readme = (res / "README.md").read_text()
    rows = {m[0]: m[1:] for m in re.findall(r"^\| `([^`]+)` \| [^|]+ \| ([^|]+) \| ([^|]+) \|", readme, re.M)}
    assert list(rows) == ONE_GPU
    assert rows["ddp-nccl"] == ("passed", "0") and rows["simulate-2.5b"] == ("passed", "0")
    assert rows["hook-vs-torch"] == ("**timed out after 5 s**", "124")
    assert rows["simulate-12.1b"] == ("**failed**", "3")
    assert rows["round-cost-345m"] == ("passed", "0") and rows["round-cost-2.5b"] == ("passed", "0")
    assert "**6 of 9 parts passed.**" in readme and "NVIDIA X100 80GB HBM9" in readme
    # the commands as run, the results folder by its place in the repository
    assert "-m edgc train --device cuda --dtype bf16 --method edgc" in readme
    assert f"--save-profile benchmarks/results/x100-{day}/gpu-check/simulate/profile-paper-2.5b.json" in readme
    assert str(tmp_path / "out") not in readme and "<tmp>/ddp-nccl" in readme
    assert (res / "simulate" / "profile-paper-2.5b.json").is_file()
    assert "no such cluster" in (res / "simulate" / "sim-paper-12.1b.txt").read_text()
    assert (res / "logs" / "ddp-nccl.log").is_file() and (res / "device.txt").is_file()
    # the run folders' small files are kept, their checkpoints and plots are not, and the
    # summary says how to redraw the plots instead of embedding them
    summary = (res / "runs" / "hsdp-nccl" / "summary.md").read_text()
    assert "![loss]" not in summary and "../../../../README.md#redrawing-the-plots" in summary
    assert not list(res.rglob("checkpoint*")) and not list(res.rglob("*.png"))
