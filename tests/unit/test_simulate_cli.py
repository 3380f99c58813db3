"""`edgc simulate` as a user runs it: the default cost model, the report's statement of it,
--device cpu only when asked, and a profile saved and loaded again."""

import argparse
import json
import re
import subprocess
import sys

import pytest

from edgc.bench import simulate as sim
from edgc.bench.simulate import (
    CostProfile,
    EntropyCost,
    RooflineModel,
    SimOptions,
    add_parser,
    cost_source,
    format_projection,
    load_cluster,
)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["simulate", *argv])


def _rows(report: str) -> dict[str, list[str]]:
    """The projection table's rows by method label, as lists of cells."""
    rows = {}
    for line in report.splitlines():
        if line.startswith("| ") and not line.startswith("| method") and "s |" in line:
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells
    return rows


def _seconds(cell: str) -> float:
    value, unit = cell.split()
    return float(value) / (1e3 if unit == "ms" else 1.0)


def _tiny_cluster(tmp_path, gpu: str | None) -> str:
    path = tmp_path / "tiny.toml"
    path.write_text('preset = "tiny"\ngpus = 4\ntp = 1\npp = 2\ndp = 2\nbandwidth = "200mbit"\nlatency = 1e-5\n'
                    'gpus_per_node = 1\nstep_compute_s = 0.05\nmicro_batch = 1\nglobal_batch = 8\nseq_len = 128\n'
                    'steps = 50\n' + (f'gpu = "{gpu}"\n' if gpu else ""))
    return str(path)


def test_edgc_simulate_paper_2_5b_as_a_user_runs_it():
    out = subprocess.run([sys.executable, "-m", "edgc", "simulate", "--cluster", "paper-2.5b"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("## edgc simulate: gpt2-2.5b")
    # the assumption opens the report: GPU, FLOP/s, bandwidth, latency, fractions
    top = lines[2]
    for words in ("roofline model of V100-SXM2", "not a measurement", "float16 gradients compressed in float32",
                  "65% of the 15.7 TFLOP/s FP32", "tensor-core peak 125 TFLOP/s", "80% of 900 GB/s",
                  "5 µs per kernel launch"):
        assert words in top
    assert "WARNING" not in out.stdout and "measured" not in top
    rows = _rows(out.stdout)
    none, psgd = rows["none"], rows["PowerSGD r=32"]
    assert 1e-3 < _seconds(psgd[3]) < 30e-3  # compression on a V100: milliseconds
    assert _seconds(psgd[6]) < _seconds(none[6])  # step time: compression pays here
    assert "Roofline cost of one PowerSGD round at r = 32" in out.stdout


def test_edgc_simulate_paper_12_1b_as_a_user_runs_it():
    out = subprocess.run([sys.executable, "-m", "edgc", "simulate", "--cluster", "paper-12.1b"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "roofline model of H100-SXM5" in out.stdout.splitlines()[2]
    assert "bfloat16 gradients compressed in float32" in out.stdout and "3,350 GB/s" in out.stdout
    rows = _rows(out.stdout)
    assert _seconds(rows["PowerSGD r=32"][6]) < _seconds(rows["none"][6])


def test_tp_layout_picks_the_libraries_vocabulary_split_its_whole_embedding_or_megatrons():
    def stage_line(*extra):
        out = subprocess.run([sys.executable, "-m", "edgc", "simulate", "--cluster", "paper-2.5b", *extra],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return next(line for line in out.stdout.splitlines() if "gradient per GPU by stage" in line), out.stdout

    # TP 4 x PP 4 on a 50257 x 1920 embedding: V / 4 on stage 0 and (but for megatron) the
    # head's copy on stage 3, or V whole on both
    vocab, report = stage_line()
    whole, whole_report = stage_line("--tp-layout", "whole")
    megatron, other = stage_line("--tp-layout", "megatron")
    assert "170.1M, 144.0M, 144.0M, 168.1M" in vocab and "split alike, synced by the last stage, as edgc train " \
        "--tp does" in report
    assert "242.4M, 144.0M, 144.0M, 240.5M" in whole and "as edgc train --tp --no-vocab-parallel does" in whole_report
    assert "170.1M, 144.0M, 144.0M, 144.0M" in megatron and "tied head counted once on stage 0" in other


def test_a_cluster_without_a_gpu_asks_for_one(tmp_path):
    out = subprocess.run([sys.executable, "-m", "edgc", "simulate", "--cluster", _tiny_cluster(tmp_path, None)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "names no GPU" in out.stderr and "--device cpu" in out.stderr and out.stdout == ""


def test_default_never_times_on_this_machine(monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("a DeviceTimer was made without --device")

    monkeypatch.setattr(sim.command, "DeviceTimer", refuse)
    cluster = load_cluster("paper-2.5b")
    source = cost_source(_args(), cluster)
    assert isinstance(source, RooflineModel) and source.gpu.name == "V100-SXM2" and source.grad_dtype == "float16"
    assert cost_source(_args("--gpu", "A100"), cluster).gpu.name == "A100-SXM4"
    assert sim.run(_args("--cluster", "paper-2.5b", "--steps", "100")) == 0
    assert "roofline model of V100-SXM2" in capsys.readouterr().out


def test_device_cpu_when_asked_warns_in_words(tmp_path, capsys):
    saved = tmp_path / "cpu.json"
    assert sim.run(_args("--cluster", _tiny_cluster(tmp_path, "V100"), "--device", "cpu", "--repeats", "1",
                         "--save-profile", str(saved))) == 0
    report = capsys.readouterr().out
    assert "measured on this machine's CPU" in report
    assert "WARNING: CPU timings are projected onto a cluster of V100-SXM2 GPUs" in report
    origins = [o["origin"] for o in json.loads(saved.read_text())["origins"]]
    assert len(origins) == 1 and origins[0].startswith("measured:cpu")
    # the same costs for a cluster that names no GPU: reported as measured, no GPU warning
    assert sim.run(_args("--cluster", _tiny_cluster(tmp_path, None), "--profile", str(saved))) == 0
    report = capsys.readouterr().out
    assert "measured on this machine's CPU" in report and "WARNING" not in report


def test_measured_on_another_gpu_says_so():
    cluster = load_cluster("paper-2.5b")
    cluster = type(cluster).from_dict({**cluster.__dict__, "preset": "tiny", "tp": 1, "pp": 1, "dp": 32,
                                       "global_batch": 128, "seq_len": 128, "steps": 10})
    profile = CostProfile()
    for m, n in ((2048, 128), (128, 128), (384, 128), (512, 128), (128, 512)):
        for r in range(1, 33):
            profile.lowrank[(m, n, r)] = 1e-6 * r
    profile.entropy[(0.25, "histogram", 1000)] = EntropyCost(0.0, 1e-12)
    proj = sim.simulate(cluster, profile, SimOptions())
    profile.origins["measured:NVIDIA H100 80GB HBM3"] = "bfloat16, median of 3 timed with CUDA events"
    report = format_projection(proj, profile)
    assert "measured on NVIDIA H100 80GB HBM3" in report
    assert "NOTE: the cluster's GPU is V100-SXM2, but these costs were measured on NVIDIA H100 80GB HBM3" in report
    profile.origins = {"measured:Tesla V100-SXM2-32GB": "float16"}
    assert "NOTE" not in format_projection(proj, profile)


@pytest.mark.parametrize("cluster", ["paper-2.5b"])
def test_save_profile_and_project_from_it(tmp_path, capsys, cluster):
    path = tmp_path / "v100.json"
    assert sim.run(_args("--cluster", cluster, "--steps", "1000", "--save-profile", str(path))) == 0
    first = capsys.readouterr().out
    d = json.loads(path.read_text())
    assert [o["origin"] for o in d["origins"]] == ["roofline:V100-SXM2"]
    assert sim.run(_args("--cluster", cluster, "--steps", "1000", "--profile", str(path))) == 0
    second = capsys.readouterr().out
    table = lambda report: re.search(r"\n\| method.*?\n\n", report, re.S).group(0)  # noqa: E731
    assert table(second) == table(first)
    assert "roofline model of V100-SXM2" in second.splitlines()[2]  # the file keeps its origin
    # a different r_max needs shapes the file has, at ranks it lacks: interpolated, no error
    assert sim.run(_args("--cluster", cluster, "--steps", "1000", "--profile", str(path), "--rank-max", "16")) == 0
