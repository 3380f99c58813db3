"""The emulated cluster harness and the benchmarks."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from edgc.bench.cluster import run_on_cluster
from edgc.bench.comm import ring_allreduce_seconds
from edgc.bench.emulation import SyncShare, measured_compute
from edgc.bench.netns import Cluster, NetnsUnavailable, parse_rate
from edgc.bench.train import first_reached, time_to_target
from edgc.cli import main
from edgc.models import build_model
from edgc.train.launch import WorkerError
from edgc.train.metrics import read_metrics
from edgc.train.summary import load_run, summarize

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="network namespaces and tc need root and iproute2",
)


def _namespaces(prefix):
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.startswith(prefix)]


def test_ring_formula_by_hand():
    # 4 ranks, 1 MB at 200 Mbit/s: 2*3/4 * 8e6 bits / 2e8 = 0.06 s, plus 6 latency terms
    assert ring_allreduce_seconds(1e6, 4, 2e8) == pytest.approx(0.06)
    assert ring_allreduce_seconds(1e6, 4, 2e8, latency=1e-3) == pytest.approx(0.066)
    assert ring_allreduce_seconds(1e6, 1, 2e8) == 0.0


def test_parse_rate():
    assert parse_rate("200mbit") == 2e8
    assert parse_rate("1gbit") == 1e9
    assert parse_rate("25mbps") == 2e8
    with pytest.raises(ValueError, match="bandwidth"):
        parse_rate("fast")


def test_time_to_target():
    recs = [{"kind": "train", "step": s, "step_time": 0.5} for s in range(1, 5)]
    recs += [{"kind": "val", "step": 2, "val_loss": 3.0}, {"kind": "val", "step": 4, "val_loss": 2.0}]
    assert time_to_target(recs, 2.5) == 2.0
    assert time_to_target(recs, 3.0) == 1.0
    assert time_to_target(recs, 1.0) == float("inf")


@needs_root
def test_cluster_sets_up_rate_limited_links_and_tears_down():
    prefix = f"edgct{os.getpid()}"
    with Cluster(2, "100mbit", prefix=prefix) as c:
        assert len(_namespaces(prefix)) == 3
        qdisc = subprocess.run(c.command(0, ["tc", "qdisc", "show", "dev", "eth0"]), capture_output=True, text=True)
        assert "tbf" in qdisc.stdout and "100Mbit" in qdisc.stdout
        # worker 0 reaches worker 1 through the bridge
        probe = [sys.executable, "-c", f"import socket; socket.create_connection(('{c.addr(1)}', 9), 2)"]
        reach = subprocess.run(c.command(0, probe), capture_output=True, text=True)
        assert "refused" in reach.stderr.lower()  # an answer (RST) from worker 1: the link works
    assert _namespaces(prefix) == []


_SEND = """
import socket, sys
host, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with socket.create_connection((host, port), 5) as s:
    s.sendall(b"x" * size)
"""
_RECEIVE = """
import socket, sys
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", int(sys.argv[1]))); srv.listen(1); print("ready", flush=True)
conn, _ = srv.accept(); got = 0
while chunk := conn.recv(1 << 16):
    got += len(chunk)
print(got, flush=True)
"""


def _transfer(c, src, dst, size, port):
    """Send `size` bytes from worker `src` to worker `dst` over TCP; returns what arrived."""
    server = subprocess.Popen(c.command(dst, [sys.executable, "-c", _RECEIVE, str(port)]), stdout=subprocess.PIPE,
                              text=True)
    assert server.stdout.readline().strip() == "ready"
    subprocess.run(c.command(src, [sys.executable, "-c", _SEND, c.addr(dst), str(port), str(size)]), check=True,
                   timeout=60)
    return int(server.communicate(timeout=60)[0].strip())


@needs_root
def test_nodes_share_one_limited_link_and_their_bytes_are_counted():
    prefix = f"edgcn{os.getpid()}"
    with Cluster(4, "100mbit", prefix=prefix, nodes=2) as c:
        assert len(_namespaces(prefix)) == 3  # the switch and 2 nodes
        assert [c.node(i) for i in range(4)] == [0, 0, 1, 1] and c.addr(0) == c.addr(1) != c.addr(2)
        start = c.link_bytes()
        assert _transfer(c, 0, 1, 2_000_000, 29511) == 2_000_000  # inside node 0: its loopback
        inside = c.link_bytes()
        assert inside[1] - start[1] >= 2_000_000 and inside[0] - start[0] < 200_000
        assert _transfer(c, 2, 0, 2_000_000, 29512) == 2_000_000  # node 1 to node 0: both links
        across = c.link_bytes()
        assert across[0] - inside[0] >= 2_000_000
    assert _namespaces(prefix) == []
    with pytest.raises(ValueError, match="divide"):
        Cluster(4, "100mbit", nodes=3)


@needs_root
@pytest.mark.slow
def test_bench_train_across_nodes_reports_wire_bytes_and_memory(tmp_path):
    out = tmp_path / "bench"
    assert main(["bench", "train", "--nodes", "2", "--nproc", "4", "--bandwidth", "1gbit", "--steps", "6",
                 "--methods", "none,hsdp-native,hsdp-edgc", "--rank", "4", "--out", str(out), "--",
                 "--batch-size", "2", "--block-size", "32", "--eval-tokens", "256", "--edgc-warmup-steps", "2",
                 "--checkpoint-every", "100"]) == 0
    text = (out / "bench.md").read_text()
    table = text.split("## Across nodes")[1].split("\n\n")[1]
    rows = {line.split("|")[1].strip(): [x.strip() for x in line.split("|")] for line in table.splitlines()}
    assert {"none", "hsdp-native", "hsdp-edgc"} <= set(rows)
    inter = {name: float(rows[name][3]) for name in ("none", "hsdp-native", "hsdp-edgc")}
    intra = {name: float(rows[name][5]) for name in ("none", "hsdp-native", "hsdp-edgc")}
    assert inter["hsdp-edgc"] < inter["hsdp-native"]  # compressed across nodes
    assert intra["hsdp-native"] > intra["none"]  # the shards' reduce-scatter and all-gathers stay inside
    state = {name: float(rows[name][7]) for name in ("none", "hsdp-native")}
    assert state["hsdp-native"] < 0.75 * state["none"]  # parameters and optimiser state sharded in two
    cfg = json.loads((out / "hsdp-edgc" / "config.json").read_text())
    assert (cfg["dp_shard"], cfg["dp_replicate"], cfg["method"]) == (2, 2, "edgc")


def test_bench_train_node_options_are_checked(tmp_path, capsys):
    assert main(["bench", "train", "--loopback", "--nodes", "3", "--nproc", "4", "--out", str(tmp_path / "a")]) == 2
    assert "divide" in capsys.readouterr().err
    assert main(["bench", "train", "--loopback", "--methods", "hsdp-native", "--out", str(tmp_path / "b")]) == 2
    assert "--nodes" in capsys.readouterr().err


@needs_root
def test_cluster_tears_down_after_a_worker_crash():
    prefix = f"edgcc{os.getpid()}"
    with pytest.raises(WorkerError, match="exited"):
        with Cluster(2, "200mbit", prefix=prefix) as c:
            run_on_cluster(c, ["train", "--method", "nonsense"], timeout=120)
    assert _namespaces(prefix) == []


def test_unavailable_without_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NetnsUnavailable, match="--loopback"):
        Cluster.check()


def test_comm_benchmark_loopback_two_workers(tmp_path, capsys):
    out = tmp_path / "comm.md"
    assert main(["bench", "comm", "--loopback", "--nproc", "2", "--steps", "2", "--warmup", "1",
                 "--rank", "8", "--out", str(out)]) == 0
    text = out.read_text()
    for method in ("| none |", "| torch-powersgd |", "| powersgd |", "| edgc r=2 |", "| edgc r=8 |",
                   "| powersgd (whole-step) |", "| edgc r=8 (whole-step) |"):
        assert method in text
    rows = {line.split("|")[1].strip(): line.split("|") for line in text.splitlines() if line.startswith("| ")}
    # bytes per step: rank 8 compresses, and sends fewer bytes than uncompressed
    assert float(rows["powersgd"][3]) < float(rows["none"][3])
    assert float(rows["edgc r=2"][3]) < float(rows["edgc r=8"][3])
    # the two sync modes cut the same bytes differently
    assert rows["powersgd"][3] == rows["powersgd (whole-step)"][3]


def test_comm_benchmark_takes_coarse_units(tmp_path, capsys):
    out = tmp_path / "comm.md"
    assert main(["bench", "comm", "--loopback", "--nproc", "2", "--steps", "2", "--warmup", "1", "--rank", "8",
                 "--bucket-mb", "0.05", "--sync-modes", "pipelined", "--min-unit-mb", "0.01", "--out", str(out)]) == 0
    text = out.read_text()
    assert "0.05 MB buckets, pipelined units of at least 0.01 MB on the wire" in text.splitlines()[0]
    assert "| powersgd |" in text and "| edgc r=8 |" in text
    capsys.readouterr()
    assert main(["bench", "comm", "--loopback", "--min-unit-mb", "-1"]) == 2
    assert "min_unit_mb=-1" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_train_loopback(tmp_path):
    out = tmp_path / "bench"
    assert main(["bench", "train", "--loopback", "--nproc", "2", "--steps", "6", "--methods",
                 "compute-only,none,edgc,edgc-wholestep", "--rank", "4", "--out", str(out), "--", "--batch-size", "2",
                 "--block-size", "32", "--eval-tokens", "256", "--edgc-warmup-steps", "2"]) == 0
    text = (out / "bench.md").read_text()
    first_table = text.split("\n\n")[2]  # (after the title and the setup line; the report's tables follow)
    rows = {line.split("|")[1].strip(): line.split("|") for line in first_table.splitlines()}
    assert {"none", "compute-only", "edgc", "edgc-wholestep"} <= set(rows)
    assert "exposed comm (ms)" in rows["run"][4] and rows["compute-only"][4].strip() == "0"
    assert (out / "loss.png").is_file() and (out / "edgc" / "metrics.jsonl").is_file()
    # the compute-only run sends nothing; the whole-step run was made in that mode
    assert (out / "compute-only" / "metrics.jsonl").is_file() and float(rows["compute-only"][8]) == 0.0
    assert json.loads((out / "edgc-wholestep" / "config.json").read_text())["edgc"]["sync_mode"] == "whole-step"
    # compute-only's loss is no target, and no ratio is taken against its zero bytes
    target = float(rows["run"][11].split("val loss")[1].split("(s)")[0])
    assert target == pytest.approx(max(float(rows[n][9]) for n in ("none", "edgc", "edgc-wholestep")), abs=1e-3)
    assert "nan" not in text
    assert "every run with `--batch-size 2 --block-size 32" in text.split("\n\n")[1]  # what was run, said


def _table(text, heading):
    """The rows of the markdown table after `heading`, by run name, as lists of cells."""
    lines = text.split(heading)[1].split("\n\n")[1].splitlines()
    return {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in lines}


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("taskset") is None or len(os.sched_getaffinity(0)) < 2, reason="taskset, 2 cores")
def test_bench_train_pinned_with_device_time_reports_time_to_a_methods_loss(tmp_path, data_dir):
    # one core per worker, emulated device time, and the time each method needs to reach
    # static rank's final loss, as the measurement runs it (on loopback, shortened),
    # static rank with float32 factors (--method-args) while every other run keeps its own
    out = tmp_path / "bench"
    assert main(["bench", "train", "--loopback", "--nproc", "2", "--cores-per-worker", "1", "--emulated-device-ms", "5",
                 "--steps", "6", "--methods", "none,edgc-static", "--rank", "4", "--target-loss-of", "edgc-static",
                 "--method-args", "edgc-static=--edgc-wire native",
                 "--out", str(out), "--", "--data", str(data_dir), "--batch-size", "2", "--block-size", "32",
                 "--eval-tokens", "256", "--eval-every", "2", "--edgc-warmup-steps", "2"]) == 0
    text = (out / "bench.md").read_text()
    assert "each worker pinned to 1 core(s) of its own, emulated device time 5 ms" in text.split("\n\n")[1]
    assert "; edgc-static also with `--edgc-wire native`" in text.split("\n\n")[1]
    assert json.loads((out / "edgc-static" / "config.json").read_text())["edgc"]["wire"] == "native"
    assert json.loads((out / "none" / "config.json").read_text())["edgc"]["wire"] == "int8"  # (the default)
    records = {}
    for name in ("none", "edgc-static"):
        config, records[name] = load_run(out / name)
        assert config["emulated_device_ms"] == 5
        # every step waited 4 blocks x (5 ms forward + 10 ms backward)
        assert min(r["step_time"] for r in records[name] if r["kind"] == "train") >= 0.060
    assert (config["method"], config["edgc"]["policy"], config["rank"]) == ("edgc", "static", 4)
    # the target is static's final validation loss, which static reaches by its last step at the latest
    static = summarize("edgc-static", config, records["edgc-static"])
    assert f"## Time to validation loss {static.final_val_loss:.4f} (edgc-static's final)" in text
    rows = _table(text, "## Time to validation loss")
    assert rows["run"][:4] == ["reached at step", "time (s)", "vs none", "vs edgc-static"]
    reached = {name: first_reached(records[name], static.final_val_loss) for name in records}
    assert reached["edgc-static"] is not None and reached["edgc-static"][0] <= 6
    for name, got in reached.items():
        assert rows[name][:2] == ([str(got[0]), f"{got[1]:.1f}"] if got else ["not reached", "—"])
    if reached["none"]:  # each ratio is the row's time over the column's
        ratio = reached["none"][1] / reached["edgc-static"][1]
        assert float(rows["none"][3].rstrip("x")) == pytest.approx(ratio, abs=0.006)
        assert float(rows["edgc-static"][2].rstrip("x")) == pytest.approx(1 / ratio, abs=0.006)
    else:  # then also the time to the worst final loss, which both reach
        assert rows["none"][3] == rows["edgc-static"][2] == "—" and "Not every run reached it" in text


@needs_root
@pytest.mark.slow
def test_bench_train_sets_the_links_for_a_sync_share(tmp_path, data_dir, capsys):
    # --sync-share: a compute-only run on loopback measures the step, and the links get the
    # rate at which the uncompressed sync takes half of it
    out = tmp_path / "bench"
    assert main(["bench", "train", "--nproc", "2", "--sync-share", "0.5", "--calibration-steps", "8",
                 "--emulated-device-ms", "10", "--steps", "8", "--methods", "none", "--out", str(out), "--",
                 "--data", str(data_dir), "--batch-size", "2", "--block-size", "32", "--eval-tokens", "256"]) == 0
    config, calibration = load_run(out / "calibration")
    assert (config["method"], config["steps"], config["emulated_device_ms"]) == ("compute-only", 8, 10)
    share = SyncShare(0.5, 2, *measured_compute(calibration))
    text = (out / "bench.md").read_text()
    assert f"{share.bandwidth} per link each way (tc tbf, namespaces, for a 50% sync share)" in text.split("\n\n")[1]
    assert share.explain() in text.split("## Link rate")[1] and share.explain() in capsys.readouterr().out
    # the limited links made the uncompressed sync a real part of none's step (unlimited
    # loopback adds a few ms to a step of over 120 ms)
    none = summarize("none", *load_run(out / "none"))
    assert 1 - share.compute_s / none.mean_step_time > 0.25


@pytest.mark.slow
def test_bench_train_reports_a_method_that_ends_diverged_and_goes_on(tmp_path, data_dir, capsys):
    # `edgc train` exits 1 for a run that ends diverged; a comparison reports it, with the
    # reason, and goes on to the next method instead of stopping (a learning rate of 1e4:
    # at 100 a compressed run could end with a huge but finite loss, as it did once the
    # warm-up check pooled its sums and compression started at another step)
    out = tmp_path / "bench"
    assert main(["bench", "train", "--loopback", "--nproc", "2", "--steps", "6", "--methods", "none,powersgd-rmax",
                 "--rank", "4", "--out", str(out), "--", "--data", str(data_dir), "--batch-size", "2",
                 "--block-size", "32", "--eval-tokens", "256", "--lr", "10000", "--checkpoint-every", "2"]) == 0
    said = capsys.readouterr().out
    for name in ("none", "powersgd-rmax"):
        assert f"[bench] {name}: ended diverged in " in said and "(training diverged: " in said, said
        assert (out / name / "summary.md").is_file()
    assert (out / "bench.md").is_file()


@pytest.mark.slow
def test_bench_pareto_on_loopback(tmp_path, data_dir):
    # the command as the README writes it, shortened: every static rank, torch's hook and EDGC
    out = tmp_path / "pareto"
    cmd = [sys.executable, "-m", "edgc", "bench", "pareto", "--data", str(data_dir), "--steps", "4", "--rank", "4",
           "--out", str(out), "--", "--batch-size", "4", "--block-size", "32", "--edgc-warmup-steps", "1",
           "--edgc-window", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (out / "pareto.md").read_text()
    for name in ("none", "powersgd-r1", "powersgd-r2", "powersgd-r4", "torch-powersgd-r4", "edgc-noise", "edgc-cqm"):
        assert f"| {name} |" in text, name
    assert (out / "pareto-bytes.png").is_file() and (out / "pareto-time.png").is_file()
    for name in ("edgc-noise", "edgc-cqm"):
        assert f"{name}: reaches" in text or f"{name}: does not reach" in text
    # each evaluation against the statics' frontier of that step (4 steps: the last evaluation only)
    assert "## Along the run" in text and "| edgc-noise: loss, bytes vs powersgd-r4, below the frontier" in text
    assert "\n| 4 | " in text.split("## Along the run")[1]
    # a second call reuses the finished runs
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.count("already done, reused") == 7
    # more policies, two runs at a time: the finished runs are reused, the new ones trained side by side
    cmd[cmd.index("--out"):cmd.index("--out")] = ["--policies", "cqm,critical,schedule=0:4,3:2", "--jobs", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("already done, reused") == 6
    text = (out / "pareto.md").read_text()
    assert "| edgc-critical |" in text and "| edgc-schedule |" in text
    ranks = [r["rank"] for r in read_metrics(out / "edgc-schedule" / "metrics.jsonl") if r["kind"] == "train"]
    assert ranks == [0, 4, 2, 2], ranks
    # leaving runs out: their rows go, the others are reused
    cmd[cmd.index("--out"):cmd.index("--out")] = ["--skip", "powersgd-r1,torch-powersgd-r4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("already done, reused") == 6
    text = (out / "pareto.md").read_text()
    assert "| powersgd-r1 |" not in text and "| torch-powersgd-r4 |" not in text and "| powersgd-r2 |" in text
    # the frontier through the ranks given, and a variant of a policy judged against it in its own wire
    variant = cmd[:cmd.index("--policies")] + ["--static-ranks", "2,4", "--policies", "noise[noise_exponent=0.5]",
                                               "--skip", "none,torch-powersgd-r4"] + cmd[cmd.index("--out"):]
    proc = subprocess.run(variant, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("already done, reused") == 2  # (ranks 2 and 4; the variant is new)
    text = (out / "pareto.md").read_text()
    assert "| edgc-noise-noise_exponent-0.5 | int8 |" in text and "| powersgd-r1 |" not in text
    assert "The static frontier's factors travel in int8" in text and "(int8 wire, as this run's)" in text
    config = json.loads((out / "edgc-noise-noise_exponent-0.5" / "config.json").read_text())
    assert config["edgc"]["noise"]["exponent"] == 0.5


def test_bench_pareto_over_seeds_pairs_the_blocks(tmp_path, data_dir):
    """--seeds 2: every run twice, the second seed's in seed1338/; the report pairs each
    run with each static rank over the same validation blocks and judges the mean over
    the seeds; a second call reuses all of them."""
    out = tmp_path / "pareto"
    cmd = [sys.executable, "-m", "edgc", "bench", "pareto", "--data", str(data_dir), "--steps", "4", "--rank", "2",
           "--static-ranks", "1,2", "--policies", "noise", "--skip", "none,torch-powersgd-r2", "--seeds", "2",
           "--out", str(out), "--", "--batch-size", "4", "--block-size", "32", "--edgc-warmup-steps", "1",
           "--edgc-window", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("powersgd-r1", "powersgd-r2", "edgc-noise"):
        first, second = load_run(out / name)[0], load_run(out / "seed1338" / name)[0]
        assert (first["seed"], second["seed"]) == (1337, 1338)
        assert (out / name / "val_blocks.npz").is_file() and (out / "seed1338" / name / "val_blocks.npz").is_file()
    text = (out / "pareto.md").read_text()
    assert "seeds 1337..1338" in text and "final val loss, mean of 2 seeds ± their SD" in text
    assert "## Paired differences" in text and "| edgc-noise | " in text.split("## Paired differences")[1]
    assert "(seeds ± " in text.split("## Paired differences")[1]
    along = text.split("## Along the run")[1].split("![loss vs bytes]")[0]
    row = next(line for line in along.splitlines() if line.startswith("| 4 | "))
    assert "combined" not in row  # (the margin paired: every evaluation's blocks kept)
    points = json.loads((out / "pareto.json").read_text())
    assert sorted((p["name"], p["seed"]) for p in points) == sorted(
        (n, s) for n in ("powersgd-r1", "powersgd-r2", "edgc-noise") for s in (1337, 1338))
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout.count("already done, reused") == 6


@pytest.mark.slow
def test_bench_pareto_diloco_runs_take_their_outer_settings(tmp_path, data_dir):
    """--diloco 2 adds diloco-h2 and edgc-diloco-h2, both with the --diloco-outer-* given
    (the other runs without them), and the report sets edgc-diloco against its twin."""
    out = tmp_path / "pareto"
    cmd = [sys.executable, "-m", "edgc", "bench", "pareto", "--data", str(data_dir), "--steps", "4", "--rank", "2",
           "--static-ranks", "2", "--policies", "noise", "--skip", "none,torch-powersgd-r2,edgc-noise",
           "--diloco", "2", "--diloco-outer-lr", "0.5", "--diloco-outer-momentum", "0.25", "--out", str(out), "--",
           "--batch-size", "4", "--block-size", "32", "--edgc-warmup-steps", "1", "--edgc-window", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name, method in (("diloco-h2", "diloco"), ("edgc-diloco-h2", "edgc-diloco")):
        config = json.loads((out / name / "config.json").read_text())
        assert (config["method"], config["diloco_inner_steps"]) == (method, 2)
        assert (config["diloco_outer_lr"], config["diloco_outer_momentum"]) == (0.5, 0.25)
    static = json.loads((out / "powersgd-r2" / "config.json").read_text())
    assert (static["diloco_outer_lr"], static["diloco_outer_momentum"]) == (0.7, 0.9)  # (edgc train's defaults)
    text = (out / "pareto.md").read_text()
    assert "the DiLoCo runs with --diloco-outer-lr 0.5 --diloco-outer-momentum 0.25" in text
    assert "| diloco-h2 |" in text and "- edgc-diloco-h2 against diloco-h2: " in text
    records = read_metrics(out / "diloco-h2" / "metrics.jsonl")
    assert [r["bytes_sent"] > 0 for r in records if r["kind"] == "train"] == [False, True, False, True]
    # one run's own options, after the others (so they win): that run alone is trained again
    cmd[cmd.index("--out"):cmd.index("--out")] = ["--method-args", "edgc-diloco-h2=--diloco-outer-lr 0.3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 2 and "holds a run with other settings" in proc.stderr, proc.stderr[-3000:]
    shutil.rmtree(out / "edgc-diloco-h2")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and proc.stdout.count("already done, reused") == 2, proc.stderr[-3000:]
    config = json.loads((out / "edgc-diloco-h2" / "config.json").read_text())
    assert (config["diloco_outer_lr"], config["diloco_outer_momentum"]) == (0.3, 0.25)
    assert "; edgc-diloco-h2 with --diloco-outer-lr 0.3" in (out / "pareto.md").read_text()


@pytest.mark.parametrize("skip, message", [("powersgd-r4", "the target"), ("powersgd-r3", "no runs named")])
def test_bench_pareto_skip_errors(tmp_path, data_dir, skip, message):
    proc = subprocess.run([sys.executable, "-m", "edgc", "bench", "pareto", "--data", str(data_dir), "--rank", "4",
                           "--skip", skip, "--out", str(tmp_path / "p")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("args, message", [
    (["--static-ranks", "1,2"], "r_max (4), the target, among them"),
    (["--static-ranks", "2,x,4"], "give ranks as integers"),
    (["--policies", "noise[noise_exponent]"], "each setting is FIELD=VALUE"),
    (["--policies", "noise;noise"], "names a run twice"),
    (["--seeds", "2", "--", "--seed", "5"], "leave --seed out"),
    (["--seeds", "0"], "must be positive"),
    (["--diloco-outer-lr", "0.5"], "give --diloco H,..."),
    (["--diloco", "0"], "every H must be at least 1"),
    (["--method-args", "diloco-h5=--diloco-outer-lr 0.3"], "not among the runs"),
    (["--diloco", "5", "--diloco-outer-momentum", "1"], "diloco_outer_momentum"),
])
def test_bench_pareto_refuses_bad_ranks_and_specs(tmp_path, data_dir, args, message):
    proc = subprocess.run([sys.executable, "-m", "edgc", "bench", "pareto", "--data", str(data_dir), "--rank", "4",
                           "--out", str(tmp_path / "p"), *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "p").exists()


def test_hook_vs_torch_counts_what_each_method_sends():
    """The benchmark's bytes per step, as its table prints them: the gradient's bytes for
    none, torch's float32 P and Q, and edgc's in the wire format it is given (the byte
    count once missed edgc's all-gathers and printed 0)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    bytes_per_step = {}
    for wire in ("int8", "native"):
        out = subprocess.run(
            [sys.executable, os.path.join(root, "benchmarks", "hook_vs_torch.py"), "--steps", "4", "--skip", "2",
             "--wire", wire],
            capture_output=True, text=True, timeout=600, check=True,
        ).stdout
        assert f"edgc wire {wire}" in out
        rows = {cells[1]: cells for line in out.splitlines()
                if line.startswith("| ") and len(cells := [c.strip() for c in line.split("|")]) > 4}
        bytes_per_step[wire] = {method: int(rows[method][4].replace(",", ""))
                                for method in ("none", "torch-powersgd", "edgc-static")}
    none, torch_psgd = bytes_per_step["native"]["none"], bytes_per_step["native"]["torch-powersgd"]
    model = build_model("tiny", vocab_size=2048, block_size=128, device="meta")  # (the benchmark's defaults)
    assert none == 4 * sum(p.numel() for p in model.parameters())
    # at the same rank and in float32, edgc sends what torch's hook sends, plus its
    # control values on the steps that have them
    assert torch_psgd <= bytes_per_step["native"]["edgc-static"] < torch_psgd + 1024
    # int8: a quarter of that, plus a bfloat16 scale per 32 values and the padding of columns
    assert torch_psgd / 4 < bytes_per_step["int8"]["edgc-static"] < torch_psgd / 2
