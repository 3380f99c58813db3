"""The emulated cluster's knobs (edgc.bench.emulation) and bench train's time to a target loss."""

import math
import os
import shutil
import subprocess
import sys

import pytest

from edgc.bench import emulation
from edgc.bench.comm import ring_allreduce_seconds
from edgc.bench.emulation import SyncShare, link_rate, measured_compute, worker_cores
from edgc.bench.netns import Cluster, parse_rate
from edgc.bench.train import _target_markdown, first_reached, resolve_target, target_table, time_to_target
from edgc.cli import main


def test_worker_cores_gives_each_worker_its_own_run_of_cores():
    assert worker_cores(2, 1, available={3, 1}) == [[1], [3]]
    assert worker_cores(2, 2, available=range(6)) == [[0, 1], [2, 3]]
    assert worker_cores(3, 1, available=range(3)) == [[0], [1], [2]]


def test_worker_cores_refuses_too_few_cores_saying_how_many():
    with pytest.raises(ValueError, match=r"needs 4 cores, but this process may use 2 \(0,1\)"):
        worker_cores(2, 2, available=[0, 1])
    with pytest.raises(ValueError, match="at least 1"):
        worker_cores(2, 0, available=range(8))


def test_worker_cores_needs_taskset(monkeypatch):
    monkeypatch.setattr(emulation.shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match="taskset"):
        worker_cores(1, 1, available=[0])


def test_link_rate_by_hand_and_against_the_ring_formula():
    # 4 workers, 1 MB: 2*3/4 * 8e6 bits must take 0.06 s -> 200 Mbit/s
    assert link_rate(1e6, 4, 0.06) == pytest.approx(2e8)
    # 2 workers send the gradient once each way: 4 MB in 0.08 s -> 400 Mbit/s
    assert link_rate(4e6, 2, 0.08) == pytest.approx(4e8)
    rate = link_rate(3.45e6, 8, 0.037)
    assert ring_allreduce_seconds(3.45e6, 8, rate) == pytest.approx(0.037)
    for bad in ((1e6, 1, 0.1), (0, 2, 0.1), (1e6, 2, 0.0)):
        with pytest.raises(ValueError, match="link rate"):
            link_rate(*bad)


@pytest.mark.parametrize("share", [0.22, 0.43])
def test_sync_share_makes_the_uncompressed_sync_that_share_of_the_step(share):
    s = SyncShare(share, workers=2, compute_s=0.120, grad_bytes=3.45e6, steps=20)
    assert s.sync_s / (s.compute_s + s.sync_s) == pytest.approx(share)
    # the links' rate carries the ring's bytes in exactly that time
    assert ring_allreduce_seconds(s.grad_bytes, 2, s.bits_per_second) == pytest.approx(s.sync_s)
    # tc's spelling of it is the same rate, to the kbit
    assert abs(parse_rate(s.bandwidth) - s.bits_per_second) <= 500
    text = s.explain()
    assert f"--bandwidth {s.bandwidth}" in text and f"{share:.0%} sync share" in text and "120.0 ms" in text
    assert "may not reach" not in text


def test_sync_share_at_43_percent_by_hand():
    # 100 ms compute: the sync must take 43/57 * 100 = 75.4 ms; 2 workers, 4 MB -> 32 Mbit / 75.4 ms
    s = SyncShare(0.43, workers=2, compute_s=0.1, grad_bytes=4e6, steps=10)
    assert s.sync_s == pytest.approx(0.0754386, rel=1e-5)
    assert s.bits_per_second == pytest.approx(3.2e7 / 0.0754386, rel=1e-5)
    assert s.bandwidth == "424186kbit"


def test_sync_share_refuses_shares_outside_0_1_and_warns_of_fast_links():
    for bad in (0.0, 1.0, 43.0, -0.2):
        with pytest.raises(ValueError, match="between 0 and 1"):
            SyncShare(bad, 2, 0.1, 1e6, 10)
    fast = SyncShare(0.9, workers=2, compute_s=0.001, grad_bytes=1e8, steps=10)
    assert fast.bits_per_second > emulation.FAST_LINK_BITS and "--emulated-device-ms" in fast.explain()


def test_measured_compute_leaves_out_the_start_and_takes_medians():
    steps = [2.0, 1.5, 0.11, 0.10, 0.12, 0.50, 0.10, 0.11]  # a slow start, one hiccup
    records = [{"kind": "train", "step": i + 1, "step_time": t, "bytes_uncompressed": 4096}
               for i, t in enumerate(steps)]
    records.insert(3, {"kind": "val", "step": 3, "val_loss": 5.0})
    assert measured_compute(records) == (pytest.approx(0.11), 4096, 6)
    with pytest.raises(ValueError, match="no training steps"):
        measured_compute([{"kind": "val", "step": 1, "val_loss": 5.0}])


def test_cluster_pins_each_worker_with_taskset():
    loop = Cluster(2, None, cores=[[0], [1]])
    assert loop.command(1, ["python", "x"]) == ["taskset", "-c", "1", "python", "x"]
    assert loop.threads(0) == 1
    ns = Cluster(2, "100mbit", prefix="edgcu1", cores=[[2, 3], [4, 5]])
    assert ns.command(0, ["python"]) == ["taskset", "-c", "2,3", "ip", "netns", "exec", "edgcu1-w0", "python"]
    assert ns.threads(1) == 2
    assert Cluster(2, None).command(0, ["python"]) == ["python"]  # not pinned
    with pytest.raises(ValueError, match="each of the 2 workers"):
        Cluster(2, None, cores=[[0]])


@pytest.mark.skipif(shutil.which("taskset") is None or len(os.sched_getaffinity(0)) < 2, reason="taskset, 2 cores")
def test_a_pinned_worker_runs_on_its_own_cores_only():
    cores = worker_cores(2, 1)
    cluster = Cluster(2, None, cores=cores)
    for i in range(2):
        argv = cluster.command(i, [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"])
        assert subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip() == str(cores[i])


def _records(losses, step_time=0.5, every=2):
    """Train records of `step_time` each, and a validation loss every `every` steps."""
    recs = []
    for step in range(1, len(losses) * every + 1):
        recs.append({"kind": "train", "step": step, "step_time": step_time})
        if step % every == 0:
            recs.append({"kind": "val", "step": step, "val_loss": losses[step // every - 1]})
    return recs


def test_first_reached_gives_the_step_and_the_training_time():
    recs = _records([3.0, 2.5, 2.0, 2.2])
    assert first_reached(recs, 2.5) == (4, 2.0)
    assert first_reached(recs, 2.1) == (6, 3.0)  # the first at or below, not the last
    assert first_reached(recs, 1.0) is None and time_to_target(recs, 1.0) == math.inf
    assert time_to_target(recs, 3.0) == 1.0
    diverged = _records([3.0, None])
    assert first_reached(diverged, 2.0) is None


def test_resolve_target():
    finals = {"none": 2.9, "compute-only": 3.5, "edgc-static": 2.95, "edgc": 3.0}
    assert resolve_target(finals) == (3.0, "the worst final")  # not compute-only's
    assert resolve_target(finals, of="edgc-static") == (2.95, "edgc-static's final")
    assert resolve_target(finals, loss=2.8) == (2.8, "given")
    with pytest.raises(ValueError, match="no run of that name"):
        resolve_target(finals, of="powersgd-rmax")
    with pytest.raises(ValueError, match="never sync"):
        resolve_target(finals, of="compute-only")
    # a diverged run's loss is a target no run reaches (the report then adds the worst final loss)
    target, how = resolve_target({"none": math.nan, "edgc": 3.0}, of="none")
    assert math.isnan(target) and "diverged" in how
    assert resolve_target({"none": math.nan, "edgc": 3.0}) == (3.0, "the worst final")


def test_target_table_ratios_are_row_over_column():
    table = target_table({"none": (8, 4.0), "edgc-static": (6, 2.0), "edgc": None})
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in table.splitlines()}
    assert rows["run"] == ["reached at step", "time (s)", "vs none", "vs edgc-static", "vs edgc"]
    assert rows["none"] == ["8", "4.0", "—", "2.00x", "—"]
    assert rows["edgc-static"] == ["6", "2.0", "0.50x", "—", "—"]
    assert rows["edgc"] == ["not reached", "—", "—", "—", "—"]


def test_a_target_some_run_misses_adds_the_worst_final_loss_which_all_reach():
    loaded = [("none", {}, _records([3.0, 2.2, 2.0])), ("edgc-static", {}, _records([3.1, 2.6, 2.3])),
              ("compute-only", {}, _records([3.0, 3.5, 4.0]))]
    finals = {"none": 2.0, "edgc-static": 2.3, "compute-only": 4.0}
    text = _target_markdown(loaded, finals, 2.0, "none's final")
    first, second = text.split("Not every run reached it")
    assert "## Time to validation loss 2.0000 (none's final)" in first and "compute-only" not in text
    assert "| edgc-static | not reached |" in first and "| none | 6 | 3.0 |" in first
    assert "## Time to validation loss 2.3000 (the worst final)" in second
    assert "| none | 4 | 2.0 | — | 0.67x |" in second and "| edgc-static | 6 | 3.0 | 1.50x | — |" in second
    # a target every run reaches: one section
    assert "Not every run" not in _target_markdown(loaded, finals, 2.3, "edgc-static's final")
    # a diverged run's NaN: no run reaches it, and the worst final loss follows
    assert "(the worst final)" in _target_markdown(loaded, finals, math.nan, "none's final, not finite")


@pytest.mark.parametrize("args, message", [
    (["--loopback", "--sync-share", "0.43"], "needs namespaces"),
    (["--sync-share", "0.43", "--bandwidth", "1gbit"], "not both"),
    (["--sync-share", "43"], "between 0 and 1"),
    (["--sync-share", "0.43", "--nproc", "1"], "2 or more workers"),
    (["--sync-share", "0.43", "--nodes", "2"], "one worker per link"),
    (["--sync-share", "0.43", "--", "--pp", "2"], "pipeline"),
    (["--loopback", "--bandwidth", "1gbit"], "--loopback has none"),
    (["--loopback", "--cores-per-worker", "100000"], "cores, but this process may use"),
    (["--loopback", "--methods", "none,edgc", "--target-loss-of", "edgc-static"], "no run of that name"),
    (["--loopback", "--emulated-device-ms", "-1"], "must be >= 0"),
    (["--loopback", "--emulated-device-ms", "5", "--", "--emulated-device-ms", "5"], "give it once"),
    (["--loopback", "--methods", "none,compute-only", "--target-loss-of", "compute-only"], "no target"),
    (["--loopback", "--methods", "edgc-schedule"], "unknown method"),
    (["--loopback", "--methods", "none,edgc", "--method-args", "edgc-static=--edgc-wire native"],
     "not among the runs"),
    (["--loopback", "--methods", "edgc", "--method-args", "edgc --edgc-wire native"], "give METHOD=ARGS"),
])
def test_bench_train_refuses_emulation_options_that_cannot_work(tmp_path, capsys, args, message):
    out = tmp_path / "b"
    assert main(["bench", "train", "--out", str(out), *args]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()  # refused before anything ran or was written


def test_bench_train_target_options_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "train", "--target-loss", "3", "--target-loss-of", "none"])
    assert "not allowed with" in capsys.readouterr().err
