"""`edgc bench train`: the same training, method by method, on an emulated slow-link cluster.

Every method runs `edgc train` with the same seed, data, model and steps on the same
cluster (one network namespace per worker, links limited with tc tbf), one method after
the other. The report compares step time, tokens/s, time in gradient communication, total
bytes, final validation loss and perplexity, and the training time each method needs to
reach a target validation loss, with the ratios of those times.

For an emulated cluster whose steps are not compute-bound (edgc.bench.emulation), each
worker can be pinned to cores of its own (--cores-per-worker), its device time emulated
(--emulated-device-ms), and the links set so that the uncompressed sync takes a given
share of the step (--sync-share) instead of a fixed --bandwidth.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import re
import shlex
import time
from pathlib import Path

import torch

from edgc.bench.cluster import run_on_cluster
from edgc.bench.emulation import SyncShare, calibrate, worker_cores
from edgc.bench.netns import Cluster, NetnsUnavailable
from edgc.models import PRESETS
from edgc.policy.registry import policy_names
from edgc.train.config import TrainConfig
from edgc.train.launch import WorkerError
from edgc.train.report import report
from edgc.train.summary import RunSummary, load_run, stage_table, summarize
from edgc.train.summary import table as markdown_table
from edgc.train.trainer import ensure_data

__all__ = ["add_parser", "first_reached", "resolve_target", "run", "target_table", "time_to_target",
           "train_on_cluster"]

MODES = {"quick": 100, "full": 600}
DEFAULT_METHODS = "none,torch-powersgd,powersgd-rmax,powersgd-rmin,edgc"
NODE_METHODS = "none,edgc,hsdp-native,hsdp-edgc"  # (with --nodes: DDP and HSDP, each uncompressed and with edgc)
DEFAULT_BANDWIDTH = "200mbit"


#: Suffix of a method spec that runs our hook in its whole-step mode ("edgc-wholestep").
WHOLE_STEP = "-wholestep"


def _method_args(spec: str, rank: int, layout: tuple[int, int] | None = None) -> tuple[str, list[str]]:
    """Run name and `edgc train` arguments for a method spec like "powersgd-rmin"; a spec
    of our hook ending in "-wholestep" runs it in its whole-step mode (EDGCConfig.sync_mode).
    `layout` (nodes, workers per node) makes the HSDP specs: "hsdp-native" (FSDP2 on the
    whole mesh), "hsdp-powersgd" and "hsdp-edgc" (sharded in each node, edgc.fsdp across)."""
    if spec.startswith("hsdp-"):
        if layout is None:
            raise ValueError(f"{spec} needs --nodes: HSDP shards the model inside each node")
        hsdp = ["--dp-replicate", str(layout[0]), "--dp-shard", str(layout[1])]
        hsdp_table = {"hsdp-native": ["--method", "none"],
                      "hsdp-powersgd": ["--method", "powersgd", "--rank", str(rank)],
                      "hsdp-edgc": ["--method", "edgc", "--rank", str(rank)]}
        if spec not in hsdp_table:
            raise ValueError(f"unknown method {spec!r}; the HSDP ones are {sorted(hsdp_table)}")
        return spec, hsdp_table[spec] + hsdp
    diloco = re.fullmatch(r"(edgc-)?diloco-h([1-9][0-9]*)", spec)
    if diloco:  # DiLoCo every H steps, whole or through edgc's core (edgc.diloco)
        return spec, ["--method", "edgc-diloco" if diloco[1] else "diloco", "--rank", str(rank),
                      "--diloco-inner-steps", diloco[2]]
    r_min = max(1, rank // 4)
    table = {
        "none": ["--method", "none"],
        # no sync at all: the step time that the others' exposed communication is measured from
        "compute-only": ["--method", "compute-only"],
        "torch-powersgd": ["--method", "torch-powersgd", "--rank", str(rank)],
        "powersgd-rmax": ["--method", "powersgd", "--rank", str(rank)],
        "powersgd-rmin": ["--method", "powersgd", "--rank", str(r_min)],
        "edgc": ["--method", "edgc", "--rank", str(rank)],
        # with --pp > 1 (after --): the stage-rank rules DAC is compared with
        "edgc-uniform": ["--method", "edgc", "--rank", str(rank), "--dac-stage-ranks", "uniform"],
        "edgc-dac-cap": ["--method", "edgc", "--rank", str(rank), "--dac-cap-at-r-max", "true"],
        "edgc-dac-measured": ["--method", "edgc", "--rank", str(rank), "--dac-slack", "measured"],
        # our hook with another rank policy, e.g. edgc-static (rank r_max throughout, after the warm-up);
        # (not schedule: its ranks would have to reach every run)
        **{f"edgc-{policy}": ["--method", "edgc", "--rank", str(rank), "--edgc-policy", policy]
           for policy in policy_names() if policy != "schedule"},
    }
    base = spec.removesuffix(WHOLE_STEP)
    ours = [name for name in table if name.startswith(("powersgd", "edgc"))]
    if base not in table or (base != spec and base not in ours):
        raise ValueError(f"unknown method {spec!r}; choose from {sorted(table)}, diloco-hH or edgc-diloco-hH (H "
                         f"inner steps), or one of {sorted(ours)} with {WHOLE_STEP!r} appended")
    return spec, table[base] + (["--edgc-sync-mode", "whole-step"] if base != spec else [])


def train_on_cluster(cluster: Cluster, train_args: list[str], run_dir: Path, steps: int, *,
                     timeout: float) -> str | None:
    """Run `edgc train TRAIN_ARGS` (writing `run_dir`, `steps` steps) on the cluster's
    workers; returns None, or the line saying why the run ended diverged when it ran to
    its last step and wrote its summary all the same (`edgc train` exits 1 for it): a
    comparison reports such a run with its loss instead of stopping. Any other failure,
    a run stopped early by --max-nonfinite-steps included, raises WorkerError."""
    try:
        run_on_cluster(cluster, train_args, timeout=timeout)
        return None
    except WorkerError as exc:
        said = [line for line in str(exc).splitlines() if "error: training diverged" in line]
        if not said or not (run_dir / "summary.md").is_file():
            raise
        _, records = load_run(run_dir)
        if max((r["step"] for r in records if r.get("kind") == "train"), default=0) != steps:
            raise
        return said[-1].split("error: ", 1)[1]


def first_reached(records: list[dict], target: float) -> tuple[int, float] | None:
    """(step, training seconds up to it) of the first validation loss at or below `target`,
    the seconds being summed step times (evaluation excluded); None if never reached."""
    elapsed, by_step = 0.0, {}
    for r in records:
        if r.get("kind") == "train":
            elapsed += r["step_time"]
            by_step[r["step"]] = elapsed
    for r in records:
        if r.get("kind") == "val" and r["val_loss"] is not None and r["val_loss"] <= target and r["step"] in by_step:
            return r["step"], by_step[r["step"]]
    return None


def time_to_target(records: list[dict], target: float) -> float:
    """Training seconds (summed step times, evaluation excluded) until the first validation
    loss at or below `target`; inf if never reached."""
    reached = first_reached(records, target)
    return math.inf if reached is None else reached[1]


def resolve_target(finals: dict[str, float], loss: float | None = None, of: str | None = None) -> tuple[float, str]:
    """The target validation loss and how it was chosen, from the runs' final validation
    losses (`finals`, by run name): `loss` as given, else run `of`'s final loss (NaN, which
    no run reaches, when that run diverged), else the worst finite final loss of the runs
    that sync (compute-only's replicas drift apart: its loss is no target); NaN when there
    is none."""
    if loss is not None:
        return loss, "given"
    if of is not None:
        if of not in finals:
            raise ValueError(f"--target-loss-of {of}: no run of that name (the runs: {', '.join(finals)})")
        if of == "compute-only":
            raise ValueError("--target-loss-of compute-only: its replicas never sync, and its loss is no target")
        return finals[of], f"{of}'s final" + ("" if math.isfinite(finals[of]) else ", not finite: the run diverged")
    usable = [v for n, v in finals.items() if n != "compute-only" and math.isfinite(v)]
    return (max(usable), "the worst final") if usable else (math.nan, "no finite final")


def target_table(reached: dict[str, tuple[int, float] | None]) -> str:
    """Markdown: per run, the step and training seconds at which it first reached the target
    (`first_reached`), and its time over each other run's ("0.62x": it needed 0.62 of that
    run's time); "—" where either run never reached it."""
    names = list(reached)
    lines = ["| run | reached at step | time (s) | " + " | ".join(f"vs {n}" for n in names) + " |",
             "|---|---|---|" + "---|" * len(names)]
    for name, got in reached.items():
        cells = [name, str(got[0]) if got else "not reached", f"{got[1]:.1f}" if got else "—"]
        for other in names:
            theirs = reached[other]
            cells.append("—" if other == name or not (got and theirs) else _ratio(got[1], theirs[1]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


_DESCRIPTION = """\
Train the same run once per method, one method after the other, each with `edgc train` on \
the same seed, data, model and steps, on an emulated cluster: one network namespace per \
worker, every link limited with tc (needs root and iproute2; --loopback runs on 127.0.0.1 \
without limits). Writes each run's folder and bench.md in --out: step time, tokens/s, time \
in gradient communication, bytes, final validation loss, and the training time each method \
needs to reach a target validation loss, with the ratios of those times. --cores-per-worker, \
--emulated-device-ms and --sync-share make the emulated cluster one whose steps are not \
compute-bound (docs/emulation.md)."""

_EXAMPLES = """\
examples:
  edgc bench train --nproc 4 --bandwidth 200mbit --mode quick       the default methods, 100 steps
  edgc bench train --loopback --nproc 2 --steps 20                  a quick look, no namespaces
  edgc bench train --methods compute-only,powersgd-rmax,powersgd-rmax-wholestep
                                                                    exposed communication, per sync mode
  edgc bench train --methods edgc,edgc-uniform -- --pp 2 --dp 2     DAC against uniform stage ranks
                                                                    (after --: edgc train options)
  edgc bench train --nproc 2 --cores-per-worker 1 --emulated-device-ms 20 --sync-share 0.43 \\
      --methods none,edgc-static,edgc --target-loss-of edgc-static \\
      --method-args "edgc-static=--edgc-long-rank-factor 1"          time to PowerSGD's loss, sync 43% of a step"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="end-to-end training per method on an emulated cluster",
                       description=_DESCRIPTION, epilog=_EXAMPLES)
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model preset of every run")
    p.add_argument("--nproc", type=int, default=4, help="workers (one per emulated node, unless --nodes)")
    p.add_argument("--nodes", type=int, default=None,
                   help="group the workers into this many nodes: unlimited links inside a node, --bandwidth "
                        "between nodes; the default methods become none, edgc, hsdp-native and hsdp-edgc")
    p.add_argument("--bandwidth", default=None, metavar="RATE",
                   help=f"per-link rate, each direction (tc syntax: 200mbit, 1gbit) (default: {DEFAULT_BANDWIDTH}, "
                        "unless --sync-share)")
    p.add_argument("--sync-share", type=float, default=None, metavar="SHARE",
                   help="instead of --bandwidth: the rate at which the uncompressed sync takes this share of the "
                        "step, sync / (compute + sync), from a short compute-only run on loopback first "
                        "(--calibration-steps); 0.22 and 0.43 are edgc simulate's paper-2.5b and paper-12.1b")
    p.add_argument("--calibration-steps", type=int, default=30,
                   help="steps of the compute-only run that --sync-share measures the compute time with")
    p.add_argument("--cores-per-worker", type=int, default=None, metavar="N",
                   help="pin each worker to N cores of its own (taskset); refused when there are fewer than "
                        "--nproc x N (default: not pinned, the workers share the cores)")
    p.add_argument("--emulated-device-ms", type=float, default=0.0, metavar="MS",
                   help="every run's `edgc train --emulated-device-ms`: each block waits MS forward and 2 x MS "
                        "backward, idle, as a host waits for its GPU")
    p.add_argument("--loopback", action="store_true", help="no namespaces or limits: 127.0.0.1")
    p.add_argument("--mode", choices=sorted(MODES), default="quick",
                   help=f"run length: {', '.join(f'{m} {n} steps' for m, n in MODES.items())}")
    p.add_argument("--steps", type=int, default=None, help="steps of every run (default: the --mode's)")
    p.add_argument("--methods", default=None,
                   help="comma-separated: none, compute-only (no sync: the exposed-communication baseline), "
                        "torch-powersgd, powersgd-rmax, powersgd-rmin, edgc, edgc-uniform, edgc-dac-cap, "
                        "edgc-dac-measured, edgc-POLICY (our hook with another rank policy: edgc-static, edgc-cqm, "
                        "...); append -wholestep to one of ours for its whole-step mode; with "
                        "--nodes also hsdp-native, hsdp-powersgd, hsdp-edgc (default: "
                        f"{DEFAULT_METHODS}, or with --nodes {NODE_METHODS})")
    p.add_argument("--rank", type=int, default=32, help="r_max; powersgd-rmin uses r_max/4")
    p.add_argument("--method-args", action="append", default=[], metavar="METHOD=ARGS",
                   help="more `edgc train` options for one method's run only, after those after -- (so they "
                        "win), e.g. \"edgc-static=--edgc-wire native\" for float32 factors in that run alone; "
                        "repeatable")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--target-loss", type=float, default=None,
                        help="validation loss for time-to-target (default: the worst final loss of all methods)")
    target.add_argument("--target-loss-of", default=None, metavar="METHOD",
                        help="time-to-target of the final validation loss of this method's run, e.g. edgc-static "
                             "(a run is timed at its evaluations: after --, a small --eval-every times it finely)")
    p.add_argument("--out", default=None, metavar="DIR", help="output folder (default: runs/bench-<time>)")
    p.add_argument("--timeout", type=float, default=3 * 3600,
                   help="seconds each method's run may take before its workers are killed")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: more `edgc train` options for every run")


def _check_emulation(args: argparse.Namespace, names: list[str], extra: list[str]) -> None:
    """Refuse, before anything runs, the emulation options that cannot work together."""
    if args.sync_share is not None:
        if args.bandwidth is not None:
            raise ValueError("give --sync-share or --bandwidth, not both: --sync-share works out the rate")
        if not 0 < args.sync_share < 1:
            raise ValueError(f"--sync-share {args.sync_share} must be between 0 and 1 (e.g. 0.43 for 43% of the step)")
        if args.loopback or args.nodes:
            raise ValueError("--sync-share sets the rate of each worker's own link: it needs namespaces (no "
                             "--loopback) and one worker per link (no --nodes)")
        if args.nproc < 2:
            raise ValueError("--sync-share needs 2 or more workers: one worker has no sync")
        if int(_flag_value(extra, "--pp") or 1) > 1:
            raise ValueError("--sync-share times a compute-only run, which a pipeline (--pp > 1) cannot make; "
                             "give --bandwidth")
        if args.calibration_steps < 4:
            raise ValueError(f"--calibration-steps {args.calibration_steps} must be at least 4")
    elif args.bandwidth is not None and args.loopback:
        raise ValueError("--bandwidth limits the namespaces' links: --loopback has none")
    if args.emulated_device_ms < 0:
        raise ValueError(f"--emulated-device-ms {args.emulated_device_ms:g} must be >= 0")
    if args.emulated_device_ms and _flag_value(extra, "--emulated-device-ms") is not None:
        raise ValueError("--emulated-device-ms is given twice, before and after --: give it once")
    if args.target_loss_of is not None:  # (refused now, not after every run has trained)
        resolve_target(dict.fromkeys(names, 0.0), of=args.target_loss_of)


def _per_method_args(values: list[str], names: list[str]) -> dict[str, list[str]]:
    """--method-args "METHOD=ARGS" values as each run's extra `edgc train` options; raises
    ValueError for a value without "=" or naming a method that is not run."""
    out: dict[str, list[str]] = {}
    for value in values:
        name, sep, rest = value.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"--method-args {value!r}: give METHOD=ARGS, e.g. \"edgc-static=--edgc-wire native\"")
        if name not in names:
            raise ValueError(f"--method-args names {name!r}, which is not among the runs ({', '.join(names)})")
        out.setdefault(name, []).extend(shlex.split(rest))
    return out


def _flag_value(args: list[str], flag: str) -> str | None:
    """The value of the last `flag VALUE` or `flag=VALUE` in `args`, or None."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def run(args: argparse.Namespace) -> int:
    steps = args.steps or MODES[args.mode]
    out = Path(args.out or f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    extra = [a for a in args.train_args if a != "--"]
    if args.nodes is not None and (args.nodes < 1 or args.nproc % args.nodes):
        raise ValueError(f"--nodes {args.nodes} must divide --nproc {args.nproc} evenly")
    layout = (args.nodes, args.nproc // args.nodes) if args.nodes else None
    methods = args.methods or (NODE_METHODS if args.nodes else DEFAULT_METHODS)
    specs = [_method_args(m.strip(), args.rank, layout) for m in methods.split(",") if m.strip()]
    _check_emulation(args, [name for name, _ in specs], extra)
    own = _per_method_args(args.method_args, [name for name, _ in specs])
    cores = worker_cores(args.nproc, args.cores_per_worker) if args.cores_per_worker is not None else None
    if not args.loopback:
        try:
            Cluster.check()
        except NetnsUnavailable as exc:
            raise ValueError(str(exc)) from None
    # tokenise once, before any worker starts (unless every run is given its own data after --)
    data = _flag_value(extra, "--data") or str(ensure_data(TrainConfig(preset=args.preset, steps=steps,
                                                                       nproc=args.nproc)))
    device = ["--emulated-device-ms", f"{args.emulated_device_ms:g}"] if args.emulated_device_ms else []
    common = ["train", "--preset", args.preset, "--data", data, "--no-progress", *device]
    out.mkdir(parents=True, exist_ok=True)
    share = None
    if args.sync_share is not None:
        print(f"[bench] calibration: compute-only, {args.calibration_steps} steps on {args.nproc} workers on "
              "loopback ...", flush=True)
        share = SyncShare(args.sync_share, args.nproc, *calibrate(
            args.nproc, cores, [*common, *extra], out / "calibration", args.calibration_steps, timeout=args.timeout))
        print(f"[bench] {share.explain()}", flush=True)
    bandwidth = None if args.loopback else share.bandwidth if share else args.bandwidth or DEFAULT_BANDWIDTH
    runs = []
    wire: dict[str, tuple[int, int]] = {}  # run -> (inter-node, intra-node) bytes measured on the links
    with Cluster(args.nproc, bandwidth, nodes=args.nodes, cores=cores) as cluster:
        for name, method_args in specs:
            run_dir = out / name
            print(f"[bench] {name}: {steps} steps on {args.nproc} workers ...", flush=True)
            t0 = time.perf_counter()
            before = cluster.link_bytes()
            diverged = train_on_cluster(
                cluster, [*common, "--steps", str(steps), "--out", str(run_dir), *method_args, *extra,
                          *own.get(name, [])],
                run_dir, steps, timeout=args.timeout)
            after = cluster.link_bytes()
            wire[name] = (after[0] - before[0], after[1] - before[1])
            print(f"[bench] {name}: {'ended diverged' if diverged else 'done'} in {time.perf_counter() - t0:.0f}s"
                  + (f" ({diverged})" if diverged else ""), flush=True)
            runs.append(run_dir)
    # the report's ratios are against its first run: one that syncs, not compute-only
    ordered = sorted(runs, key=lambda d: d.name == "compute-only")
    table = markdown_table(report(ordered, out))
    text = _bench_markdown(args, steps, runs, table, cluster, share, own)
    if args.nodes and cluster.emulated:
        text += _nodes_markdown(runs, wire)
    (out / "bench.md").write_text(text)
    print(text, end="")
    print(f"report: {out / 'bench.md'}")
    return 0


def _bench_markdown(args: argparse.Namespace, steps: int, runs: list[Path], table: str, cluster: Cluster,
                    share: SyncShare | None, own: dict[str, list[str]]) -> str:
    loaded = [(d.name, *load_run(d)) for d in runs]
    sums = {n: summarize(n, c, r) for n, c, r in loaded}
    comm = {n: _mean_comm_time(r) for n, _, r in loaded}
    target, chosen = resolve_target({n: s.final_val_loss for n, s in sums.items()}, args.target_loss,
                                    args.target_loss_of)
    base = sums.get("none")
    compute = sums.get("compute-only")  # (its step time has no communication in it)
    lines = [
        "| run | step time (ms) | vs none | exposed comm (ms) | tokens/s | comm time / step (ms) | comm vs none | "
        f"MB sent | val loss | vs none | time to val loss {target:.3f} (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, _, records in loaded:
        s = sums[name]
        ttt = time_to_target(records, target)
        exposed = f"{(s.mean_step_time - compute.mean_step_time) * 1e3:.0f}" if compute else "-"
        lines.append(
            f"| {name} | {s.mean_step_time * 1e3:.0f} | "
            f"{_ratio(s.mean_step_time, base.mean_step_time if base else None)} | {exposed} | "
            f"{s.mean_tokens_per_s:,.0f} | {comm[name] * 1e3:.0f} | {_ratio(comm[name], comm.get('none'))} | "
            f"{s.total_bytes / 1e6:.1f} | {s.final_val_loss:.4f} | "
            f"{_ratio(s.final_val_loss, base.final_val_loss if base else None, pct=True)} | "
            f"{'not reached' if math.isinf(ttt) else f'{ttt:.1f}'} |"
        )
    extra = [a for a in args.train_args if a != "--"]
    link = ("loopback, no limit" if not cluster.emulated else f"{cluster.bandwidth} per link each way (tc tbf, "
            f"namespaces{f', for a {share.share:.0%} sync share' if share else ''})")
    if cluster.cores:
        link += f", each worker pinned to {len(cluster.cores[0])} core(s) of its own"
    if args.emulated_device_ms:
        link += f", emulated device time {args.emulated_device_ms:g} ms per block forward (x2 backward)"
    return (
        f"# edgc bench train\n\n{args.preset}, {args.nproc} workers, {link}, {steps} steps, r_max {args.rank}; "
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
        + (f"; every run with `{' '.join(extra)}`" if extra else "")
        + "".join(f"; {name} also with `{' '.join(a)}`" for name, a in own.items()) + ".\n\n"
        + "\n".join(lines) + "\n\n"
        + _target_markdown(loaded, {n: s.final_val_loss for n, s in sums.items()}, target, chosen)
        + (_share_markdown(share, sums.get("none")) if share else "")
        + stage_table(loaded) + table
        + "\nStep and communication times leave out the first 5% of steps. Exposed comm is the step time minus "
        "the compute-only run's (no sync at all; its replicas drift apart, and its loss means nothing). "
        "Communication time is the time the gradient-sync hook waited for its collectives: all of it for "
        "none, torch-powersgd and the -wholestep runs, and for the pipelined mode of ours only the part "
        "the backward pass did not hide.\n\n"
        "![loss](loss.png)\n![rank](rank.png)\n![bytes](bytes.png)\n"
    )


def _target_markdown(loaded: list[tuple[str, dict, list[dict]]], finals: dict[str, float], target: float,
                     chosen: str) -> str:
    """The time-to-target section: when and how soon each run (compute-only aside) first
    reached `target`; when one never did, the same for the worst final loss too, which
    every run that ended with a finite loss reached."""
    def section(loss: float, how: str) -> tuple[str, bool]:
        reached = {n: first_reached(r, loss) for n, _, r in loaded if n != "compute-only"}
        return f"## Time to validation loss {loss:.4f} ({how})\n\n" + target_table(reached), None in reached.values()

    text, missed = section(target, chosen)
    worst, how = resolve_target(finals)
    if missed and math.isfinite(worst) and worst != target:
        text += ("\nNot every run reached it; the worst final loss, which every run reached (but one that "
                 "diverged):\n\n" + section(worst, how)[0])
    return text + ("\nTraining time is the summed step times (evaluation left out) up to the first evaluation at or "
                   "below the target; a ratio is the row's time over the column's (below 1: the row's run got there "
                   "sooner).\n\n")


def _share_markdown(share: SyncShare, none: RunSummary | None) -> str:
    """How --sync-share set the links, and the share the uncompressed run then measured."""
    text = share.explain()
    if none is not None:
        measured = 1 - share.compute_s / none.mean_step_time
        text += (f" Measured: none's mean step took {none.mean_step_time * 1e3:.1f} ms, so its sync (and whatever "
                 f"else the links added to the compute-only step) took {measured:.0%} of it; TCP/IP framing, gloo's "
                 "own work and the token bucket's bursts make this differ from the share asked for.")
    return "## Link rate\n\n" + text + "\n\n"


def _nodes_markdown(runs: list[Path], wire: dict[str, tuple[int, int]]) -> str:
    """The nodes table: each run's step time, the bytes measured on the nodes' links and
    loopbacks, its validation loss ± SE, and one worker's memory (edgc train's "memory"
    record, rank 0's)."""
    lines = ["\n## Across nodes\n",
             "| run | step time (ms) | inter-node MB | vs first | intra-node MB | val loss ± SE | "
             "state MB / worker | peak MB / worker |",
             "|---|---|---|---|---|---|---|---|"]
    first = None
    for d in runs:
        config, records = load_run(d)
        s = summarize(d.name, config, records)
        inter, intra = wire[d.name]
        first = first or inter
        memory: dict = next((r for r in reversed(records) if r.get("kind") == "memory"), {})
        val = [r for r in records if r.get("kind") == "val"]
        se = val[-1].get("val_loss_se") if val else None
        lines.append(f"| {d.name} | {s.mean_step_time * 1e3:.0f} | {inter / 1e6:.1f} | {_ratio(inter, first)} | "
                     f"{intra / 1e6:.1f} | {s.final_val_loss:.4f} ± {se if se is not None else float('nan'):.4f} | "
                     f"{memory.get('state_mb', float('nan')):.1f} | {memory.get('peak_mb', float('nan')):.0f} |")
    return ("\n".join(lines) + "\n\nInter-node and intra-node bytes are what the nodes' links and loopbacks sent "
            "during the run (kernel counters: evaluation, checkpoints' gathers and the collectives' own framing "
            "included). State is the parameters, optimiser state and compression state a worker holds; peak is the "
            "peak CUDA memory allocated, or on the CPU the process's peak resident set.\n")


def _mean_comm_time(records: list[dict]) -> float:
    """Mean per-step gradient-communication time, leaving out the first 5% of steps."""
    train = [r for r in records if r.get("kind") == "train"]
    timed = train[len(train) // 20 :] or train
    return sum(r["comm_time"] for r in timed) / len(timed)


def _ratio(value: float, base: float | None, pct: bool = False) -> str:
    if not base:
        return "-"
    if pct:
        return f"{(value / base - 1) * 100:+.2f}%"
    return f"{value / base:.2f}x"
