"""`edgc bench pareto`: every static rank against each dynamic policy, on the same data and seed.

A dynamic rank policy earns its place only if it lies beyond what static PowerSGD can do:
for the bytes it sent (or the time it took), no static rank reaches a lower validation
loss. The sweep trains, one after the other on the same workers:

- `none` (plain all-reduce),
- our PowerSGD at every rank r_max, r_max/2, r_max/4, r_max/8 (powers of two, at least 1),
  or at the ranks of --static-ranks (the frontier joins its points with straight lines in
  log bytes, so ranks between the powers of two draw it closer: a policy between r_max/2
  and r_max is judged against what a static rank there actually reaches),
- torch's `powerSGD_hook` at r_max,
- each dynamic policy asked for (`--policies`),

and draws loss against bytes and loss against wall time with the static ranks joined as
the frontier (a static rank that another beats in both is left out of it: a low rank whose
warm-up ran longer can send more and end higher). A point's verdict compares its final
validation loss with the frontier's, interpolated at the same bytes (or time) in log
space: "beyond" (lower by more than the margin), "on" (within it) or "behind". Outside the
frontier's range a point is judged against the nearest static point only if it dominates
or is dominated by it, or is "on" it (within 1% of its bytes or time, and its loss within
the margin); otherwise "outside the frontier".

**The margin.** Every run is evaluated on the same validation blocks and keeps each
block's loss (`val_blocks.npz`), so the gap below the frontier is measured block by block:
the frontier's loss on a block is its two static neighbours' block losses, interpolated
with the same weight, and the gap's standard error is that of the per-block gaps (the
*paired* SE). It is much smaller than the two losses' combined SE, which counts the
blocks' own spread (some text is harder than other) twice although it moves both losses
alike. The paired SE measures the evaluation's noise only: a run with another seed
(another initialisation and batch order) lands elsewhere. `--seeds N` repeats every run
over N seeds and judges the mean gap over them, with the larger of two margins: the paired
SE of that mean, and its seed SE (the seeds' spread of the gap over sqrt(N)). With one
seed the margin is the paired SE alone, and the verdict is that seed's. Runs from before
the block losses were kept are judged with the combined SE, as they were then.

Runs whose folder already holds a finished run of the same settings are reused, so a long
sweep can be stopped and continued.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from edgc.bench.frontier import (
    END_TOLERANCE,
    Judgement,
    ParetoPoint,
    combine,
    difference,
    frontier_gap,
    frontier_verdict,
    judge,
    paired_gap,
)
from edgc.bench.netns import Cluster, NetnsUnavailable
from edgc.bench.train import _method_args, _per_method_args, time_to_target, train_on_cluster
from edgc.models import PRESETS
from edgc.policy.registry import policy_names
from edgc.train.blocks import block_losses_by_step, load_block_losses
from edgc.train.config import TrainConfig
from edgc.train.summary import load_run
from edgc.train.trainer import ensure_data

# (the frontier's arithmetic lives in edgc.bench.frontier; its names are kept here too)
__all__ = ["END_TOLERANCE", "Judgement", "ParetoPoint", "add_parser", "along_markdown", "frontier_gap",
           "frontier_verdict", "judge", "paired_gap", "pareto_markdown", "parse_ranks", "points_along", "run",
           "run_dir", "static_ranks", "sweep"]


def static_ranks(r_max: int) -> list[int]:
    """r_max, r_max/2, r_max/4, r_max/8 (integer, at least 1, distinct), ascending."""
    return sorted({max(1, r_max >> k) for k in range(4)})


def split_policies(text: str) -> list[str]:
    """Policy specs from --policies: separated by ';', or by ',' outside a schedule's knots
    and outside a spec's [settings]."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += (c == "[") - (c == "]")
        if c == ";" or (c == "," and depth == 0 and ";" not in text):
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    specs: list[str] = []
    for part in (p.strip() for p in parts):
        if part and specs and specs[-1].startswith("schedule=") and "=" not in part and ":" in part:
            specs[-1] += "," + part  # another knot of the schedule before it
        elif part:
            specs.append(part)
    return specs


def _settings(spec: str) -> tuple[str, list[tuple[str, str]]]:
    """"noise[noise_exponent=0.5,long_rank_factor=1]" -> ("noise", [(field, value), ...]):
    EDGCConfig fields, by their flat names, set for that run only."""
    name, bracket, rest = spec.partition("[")
    if not bracket:
        return spec, []
    if not rest.endswith("]"):
        raise ValueError(f"{spec!r}: settings go in brackets, as noise[noise_exponent=0.5]")
    pairs = []
    for item in (i.strip() for i in rest[:-1].split(",") if i.strip()):
        field, eq, value = item.partition("=")
        if not eq or not field.strip() or not value.strip():
            raise ValueError(f"{spec!r}: each setting is FIELD=VALUE, as noise_exponent=0.5")
        pairs.append((field.strip(), value.strip()))
    return name, pairs


def parse_ranks(text: str, r_max: int) -> list[int]:
    """--static-ranks: ranks separated by ',', each in [1, r_max], r_max among them; ascending."""
    try:
        ranks = sorted({int(r) for r in text.split(",") if r.strip()})
    except ValueError:
        raise ValueError(f"--static-ranks {text!r}: give ranks as integers separated by ','") from None
    if not ranks or ranks[0] < 1 or ranks[-1] != r_max:
        raise ValueError(f"--static-ranks {text!r}: ranks in [1, {r_max}], with r_max ({r_max}), the target, "
                         "among them")
    return ranks


def sweep(r_max: int, policies: list[str], ranks: list[int] | None = None, diloco: list[int] | None = None,
          outer: list[str] | None = None) -> list[tuple[str, str, int | None, list[str]]]:
    """(run name, kind, rank, `edgc train` arguments) for every run of the sweep. A policy
    spec is a name, "schedule=STEP:RANK,...", or a name with EDGCConfig fields for its run
    in brackets ("noise[noise_exponent=0.5]": run "edgc-noise-noise_exponent-0.5").
    `ranks`: the static ranks (default `static_ranks(r_max)`). `diloco`: the H of a DiLoCo
    run and an edgc-diloco run each ("diloco-h20", "edgc-diloco-h20": edgc.diloco), with
    `outer` (`edgc train`'s --diloco-outer-* options) added to both."""
    runs: list[tuple[str, str, int | None, list[str]]] = [("none", "none", None, ["--method", "none"])]
    for r in ranks or static_ranks(r_max):
        runs.append((f"powersgd-r{r}", "static", r, ["--method", "powersgd", "--rank", str(r)]))
    runs.append((f"torch-powersgd-r{r_max}", "torch", r_max, ["--method", "torch-powersgd", "--rank", str(r_max)]))
    for spec in policies:
        named, settings = _settings(spec)
        policy, _, schedule = named.partition("=")
        if policy not in policy_names() or policy == "static":
            dynamic = [p for p in policy_names() if p != "static"]
            raise ValueError(f"unknown dynamic policy {policy!r}; choose from {dynamic}")
        if (policy == "schedule") != bool(schedule):
            raise ValueError(f'{spec!r}: give a schedule as schedule=STEP:RANK,... and only for "schedule"')
        extra = ["--edgc-schedule-ranks", schedule] if schedule else []
        for field, value in settings:
            extra += [f"--edgc-{field.replace('_', '-')}", value]
        name = "-".join([f"edgc-{policy}", *(f"{f}-{v}" for f, v in settings)])
        args = ["--method", "edgc", "--rank", str(r_max), "--edgc-policy", policy, *extra]
        runs.append((name, "dynamic", r_max, args))
    for h in diloco or ():  # (the arguments of edgc bench train's method specs of the same names)
        for name, kind, rank in ((f"diloco-h{h}", "diloco", None), (f"edgc-diloco-h{h}", "edgc-diloco", r_max)):
            runs.append((name, kind, rank, _method_args(name, r_max)[1] + list(outer or ())))
    names = [name for name, *_ in runs]
    if len(names) != len(set(names)):
        raise ValueError(f"--policies or --diloco names a run twice: {names}")
    return runs


def _wire(config: dict, kind: str) -> str:
    """What a run's sums travelled in: EDGCConfig.wire, "native" for torch's hook, "-" for none."""
    edgc = config.get("edgc") or {}
    compressed = ("static", "dynamic", "edgc-diloco")
    return "-" if kind == "none" else str(edgc.get("wire", "native")) if kind in compressed else "native"


def _point(name: str, kind: str, rank: int | None, run_dir: Path, target: float | None) -> ParetoPoint:
    config, records = load_run(run_dir)
    train = [r for r in records if r.get("kind") == "train"]
    val = [r for r in records if r.get("kind") == "val"]
    last = val[-1] if val else {}
    loss = last.get("val_loss")
    return ParetoPoint(
        name=name, kind=kind, rank=rank,
        val_loss=float(loss) if loss is not None else math.nan,
        val_se=float(last.get("val_loss_se") or 0.0),
        bytes=float(sum(r["bytes_sent"] for r in train)),
        seconds=float(sum(r["step_time"] for r in train)),
        time_to_target=time_to_target(records, target) if target is not None else math.inf,
        wire=_wire(config, kind),
        seed=int(config.get("seed", TrainConfig.seed)),
        # (its last evaluation's blocks: they pair with the final loss)
        blocks=load_block_losses(run_dir, last["step"]) if last else None,
    )


def run_dir(out: Path, name: str, seed: int, first_seed: int) -> Path:
    """Where the sweep trains run `name` with `seed`: out/name for the first seed (so a
    sweep of one seed is where it always was), out/seed<S>/name for the others."""
    return out / name if seed == first_seed else out / f"seed{seed}" / name


def points_along(name: str, kind: str, rank: int | None, run_dir: Path) -> dict[int, ParetoPoint]:
    """The run's point at each of its evaluations: {step: the validation loss then, with the
    bytes sent and the step time summed up to that step}."""
    config, records = load_run(run_dir)
    blocks = block_losses_by_step(run_dir)
    sent: dict[int, tuple[float, float]] = {}
    total = seconds = 0.0
    for r in records:
        if r.get("kind") == "train":
            total += r["bytes_sent"]
            seconds += r["step_time"]
            sent[r["step"]] = (total, seconds)
    return {r["step"]: ParetoPoint(name=name, kind=kind, rank=rank, val_loss=float(r["val_loss"]),
                                   val_se=float(r.get("val_loss_se") or 0.0), bytes=sent[r["step"]][0],
                                   seconds=sent[r["step"]][1], time_to_target=math.inf, wire=_wire(config, kind),
                                   blocks=blocks.get(r["step"]))
            for r in records if r.get("kind") == "val" and r.get("val_loss") is not None and r["step"] in sent}


def along_markdown(along: dict[str, dict[int, ParetoPoint]], target_name: str) -> str:
    """A table of every dynamic run against the static frontier at each evaluation the runs
    share: the frontier drawn from the static runs' losses then and their bytes up to then,
    the margin the gap's paired SE where the three runs kept that evaluation's block losses
    (else the two losses' combined SE, marked). Empty without a dynamic run or with fewer
    than two static ones."""
    statics = [name for name, pts in along.items() if pts and next(iter(pts.values())).kind == "static"]
    dynamics = [name for name, pts in along.items() if pts and next(iter(pts.values())).kind == "dynamic"]
    if not dynamics or len(statics) < 2 or target_name not in statics:
        return ""
    steps = sorted(set.intersection(*(set(along[name]) for name in statics + dynamics)))
    lines = ["| step | " + f"{target_name}'s loss | "
             + " | ".join(f"{name}: loss, bytes vs {target_name}, below the frontier (margin)" for name in dynamics)
             + " |", "|---|---|" + "---|" * len(dynamics)]
    for step in steps:
        ref = along[target_name][step]
        cells = []
        for name in dynamics:
            p = along[name][step]
            then = [along[s][step] for s in statics]
            paired = paired_gap(p, then)
            gap = paired or frontier_gap(p, then)
            cells.append(f"{p.val_loss:.4f}, {p.bytes / ref.bytes:.3f}x, "
                         + ("outside the frontier" if gap is None
                            else f"{gap[0]:+.4f} ({gap[1]:.4f}{'' if paired else ' combined'})"))
        lines.append(f"| {step} | {ref.val_loss:.4f} | " + " | ".join(cells) + " |")
    return ("## Along the run\n\nAt each evaluation, each dynamic run against the static frontier of that step (the "
            "static runs' losses then, against the bytes they had sent by then): whether a verdict holds through the "
            "run or only at its end. The first seed's runs; the margin is the gap's paired SE over the validation "
            "blocks, or the two losses' combined SE (marked \"combined\") where a run kept no block losses of that "
            "evaluation (runs made before each evaluation's block losses were kept).\n\n" + "\n".join(lines) + "\n\n")


def _finished(run_dir: Path, args_list: list[str], steps: int) -> bool:
    """A finished run of these settings is already in `run_dir` (reused, not retrained)."""
    marker = run_dir / "pareto-args.json"
    if not (marker.is_file() and (run_dir / "summary.md").is_file()):
        return False
    if json.loads(marker.read_text()) != args_list:
        raise ValueError(f"{run_dir} holds a run with other settings; choose another --out or remove it")
    _, records = load_run(run_dir)
    return any(r.get("kind") == "train" and r["step"] == steps for r in records)


_DESCRIPTION = """\
Train, on the same data and seed, one after the other: none (plain all-reduce), our \
PowerSGD at every static rank r_max/8 .. r_max, torch's PowerSGD hook at r_max, and each \
dynamic policy of --policies; then plot validation loss against bytes and against time, \
the static ranks joined as the frontier, and say in pareto.md whether each dynamic policy \
lies beyond, on or behind it (the margin: the SE of the per-block gaps over the validation \
blocks every run shares; with --seeds N, the larger of that and the seeds' SE). On \
loopback unless --bandwidth asks for an emulated cluster. Finished runs in --out are \
reused, so a stopped sweep continues where it was."""

_EXAMPLES = """\
examples:
  edgc bench pareto --steps 1000                                     noise and cqm against static ranks
  edgc bench pareto --policies "cqm;linear;schedule=0:32,500:16"     three dynamic policies
  edgc bench pareto --policies "noise;noise[noise_exponent=0.5]"      the default and a variant of it
  edgc bench pareto --jobs 2 --skip powersgd-r4,torch-powersgd-r32   2 runs at once, 2 runs left out
  edgc bench pareto --data data/mine --bandwidth 200mbit -- --lr 3e-4
                                                                     emulated links; after --: edgc train options"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pareto", help="every static rank against the dynamic policies: loss vs bytes and time",
                       description=_DESCRIPTION, epilog=_EXAMPLES)
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model preset of every run")
    p.add_argument("--data", default=None, metavar="DIR",
                   help="a folder from `edgc prepare` (default: the built-in corpus)")
    p.add_argument("--steps", type=int, default=1000, help="steps of every run")
    p.add_argument("--nproc", type=int, default=2, help="workers of every run")
    p.add_argument("--rank", type=int, default=32, help="r_max; static ranks r_max/8 .. r_max")
    p.add_argument("--policies", default="noise;cqm",
                   help="dynamic policies, separated by ';' or ',' (EDGCConfig.policy); a rank schedule as "
                        "schedule=STEP:RANK,... (e.g. \"cqm;schedule=0:32,500:16\"); EDGCConfig fields for one "
                        "run in brackets, by their flat names (e.g. \"noise;noise[noise_exponent=0.5]\") "
                        "(default: noise;cqm, the default policy and the paper's)")
    p.add_argument("--static-ranks", default=None, metavar="R,R,...",
                   help="the static ranks that draw the frontier, r_max among them (default: r_max/8, r_max/4, "
                        "r_max/2, r_max); more ranks between them draw it closer, e.g. 8,16,24,32 (default: "
                        "the powers of two)")
    p.add_argument("--diloco", default="", metavar="H,H,...",
                   help="also a DiLoCo run and an edgc-diloco run at each of these inner steps H (e.g. 5,20,50: "
                        "diloco-h5, edgc-diloco-h5, ...; edgc.diloco) (default: none)")
    p.add_argument("--diloco-outer-lr", type=float, default=None, metavar="LR",
                   help="the outer learning rate of every --diloco run (default: edgc train's, the paper's 0.7)")
    p.add_argument("--diloco-outer-momentum", type=float, default=None, metavar="MU",
                   help="the outer Nesterov momentum of every --diloco run (default: edgc train's, the paper's 0.9)")
    p.add_argument("--method-args", action="append", default=[], metavar="RUN=ARGS",
                   help="more `edgc train` options for one run only, by its name, after those after -- (so they "
                        "win), e.g. \"edgc-diloco-h5=--diloco-outer-lr 0.4\"; repeatable (a run's options are "
                        "part of its settings: a finished run given others is not reused)")
    p.add_argument("--skip", default="",
                   help="runs to leave out, by name, separated by ',' (e.g. \"powersgd-r4,torch-powersgd-r32\"); "
                        "static r_max, the target, cannot be left out")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs trained at once (loopback only): bytes and loss are unchanged, but the runs share "
                        "the machine, so wall times are not comparable; 1 for the time plot")
    p.add_argument("--bandwidth", default=None, metavar="RATE",
                   help="per-link rate on an emulated cluster (needs root; tc syntax, e.g. 200mbit) (default: "
                        "loopback, no limit: bytes and loss; wall time is not a network's)")
    p.add_argument("--out", default=None, metavar="DIR", help="output folder (default: runs/pareto-<time>)")
    p.add_argument("--seeds", type=int, default=1, metavar="N",
                   help="train every run with N seeds (1337, 1338, ...; each a new initialisation and batch order) "
                        "and judge the mean over them, with the seeds' spread in the margin (default: 1)")
    p.add_argument("--timeout", type=float, default=6 * 3600,
                   help="seconds each run may take before its workers are killed")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: more `edgc train` options for every run")


def run(args: argparse.Namespace) -> int:
    if args.steps < 1 or args.nproc < 1 or args.rank < 1 or args.jobs < 1 or args.seeds < 1:
        raise ValueError("--steps, --nproc, --rank, --jobs and --seeds must be positive")
    if args.jobs > 1 and args.bandwidth is not None:
        raise ValueError("--jobs > 1 shares the machine between runs; "
                         "an emulated cluster (--bandwidth) times one at a time")
    out = Path(args.out or f"runs/pareto-{time.strftime('%Y%m%d-%H%M%S')}")
    extra = [a for a in args.train_args if a != "--"]
    if args.seeds > 1 and any(a == "--seed" or a.startswith("--seed=") for a in extra):
        raise ValueError(f"--seeds {args.seeds} sets every run's seed (1337, 1338, ...); "
                         "leave --seed out of the edgc train options")
    ranks = parse_ranks(args.static_ranks, args.rank) if args.static_ranks else None
    try:
        diloco = [int(h) for h in args.diloco.split(",") if h.strip()]
    except ValueError:
        raise ValueError(f"--diloco {args.diloco!r}: give inner steps as integers separated by ','") from None
    if any(h < 1 for h in diloco):
        raise ValueError(f"--diloco {args.diloco!r}: every H must be at least 1")
    # the DiLoCo runs' outer step, as TrainConfig fields and as their edgc train options
    outer_fields = {k: v for k, v in (("diloco_outer_lr", args.diloco_outer_lr),
                                      ("diloco_outer_momentum", args.diloco_outer_momentum)) if v is not None}
    outer = [a for k, v in outer_fields.items() for a in (f"--{k.replace('_', '-')}", repr(v))]
    if outer and not diloco:
        raise ValueError("--diloco-outer-lr and --diloco-outer-momentum set the --diloco runs; give --diloco H,...")
    runs = sweep(args.rank, split_policies(args.policies), ranks, diloco, outer)
    skip = {name.strip() for name in args.skip.split(",") if name.strip()}
    unknown = skip - {name for name, *_ in runs}
    if unknown or f"powersgd-r{args.rank}" in skip:
        raise ValueError(f"--skip {args.skip}: " + (f"no runs named {sorted(unknown)} in this sweep "
                         f"({', '.join(name for name, *_ in runs)})" if unknown else
                         f"powersgd-r{args.rank} is the target every run is measured against"))
    runs = [r for r in runs if r[0] not in skip]
    own = _per_method_args(args.method_args, [name for name, *_ in runs])
    if args.bandwidth is not None:
        try:
            Cluster.check()
        except NetnsUnavailable as exc:
            raise ValueError(str(exc)) from None
    base = TrainConfig(preset=args.preset, steps=args.steps, nproc=args.nproc, data=args.data)
    base.validate()
    if outer:  # (refused here, before any run trains, as edgc train would refuse the first DiLoCo run)
        dataclasses.replace(base, method="diloco", **outer_fields).validate()
    data = ensure_data(base)  # tokenise once, before any worker starts
    first = TrainConfig.seed
    seeds = [first + k for k in range(args.seeds)]
    out.mkdir(parents=True, exist_ok=True)
    with Cluster(args.nproc, args.bandwidth) as cluster:
        todo = []
        total = len(runs) * len(seeds)
        for i, (seed, (name, _, _, method_args)) in enumerate(((s, r) for s in seeds for r in runs), 1):
            folder = run_dir(out, name, seed, first)
            label = name if seed == first else f"{name} (seed {seed})"
            train_args = ["train", "--preset", args.preset, "--steps", str(args.steps), "--data", str(data),
                          "--out", str(folder), "--no-progress", *method_args,
                          *([] if seed == first else ["--seed", str(seed)]), *extra, *own.get(name, [])]
            if _finished(folder, train_args, args.steps):
                print(f"[pareto] {i}/{total} {label}: already done, reused", flush=True)
            else:
                todo.append((i, label, folder, train_args))

        def train(i: int, label: str, folder: Path, train_args: list[str]) -> None:
            print(f"[pareto] {i}/{total} {label}: {args.steps} steps on {args.nproc} workers ...", flush=True)
            t0 = time.perf_counter()
            diverged = train_on_cluster(cluster, train_args, folder, args.steps, timeout=args.timeout)
            (folder / "pareto-args.json").write_text(json.dumps(train_args))
            print(f"[pareto] {i}/{total} {label}: {'ended diverged' if diverged else 'done'} in "
                  f"{time.perf_counter() - t0:.0f}s" + (f" ({diverged})" if diverged else ""), flush=True)

        with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # (each run is its own processes)
            for done in [pool.submit(train, *job) for job in todo]:
                done.result()  # the first failure, in sweep order
    static_max = f"powersgd-r{args.rank}"
    points = []
    for seed in seeds:
        target = _point(static_max, "static", args.rank, run_dir(out, static_max, seed, first), None).val_loss
        points += [_point(name, kind, rank, run_dir(out, name, seed, first), target) for name, kind, rank, _ in runs]
    link = f"{args.bandwidth} per link each way (tc tbf, namespaces)" if args.bandwidth else "loopback, no limit"
    along = {name: points_along(name, kind, rank, out / name) for name, kind, rank, _ in runs}
    text = pareto_markdown(points, statistics.fmean(p.val_loss for p in points if p.name == static_max), static_max,
                           f"{args.preset}, {args.nproc} workers, {link}, {args.steps} steps, r_max {args.rank}, "
                           f"data {args.data or 'built-in corpus'}, "
                           + (f"seeds {seeds[0]}..{seeds[-1]}" if len(seeds) > 1 else f"seed {first}")
                           + (f"; the DiLoCo runs with {' '.join(outer)}" if outer else "")
                           + "".join(f"; {name} with {' '.join(more)}" for name, more in own.items())
                           + f"; {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}.",
                           along_markdown(along, static_max))
    plot_pareto(points, out)
    (out / "pareto.md").write_text(text)
    (out / "pareto.json").write_text(json.dumps([p.record() for p in points], indent=1, default=str) + "\n")
    print(text, end="")
    print(f"report: {out / 'pareto.md'}")
    return 0


def _by_run(points: list[ParetoPoint]) -> tuple[dict[str, list[ParetoPoint]], list[int]]:
    """({run name: its points, one a seed, in the order of the seeds}, the seeds): the runs
    in the order they first appear. Raises ValueError if the runs do not share their seeds."""
    seeds = sorted({p.seed for p in points})
    runs: dict[str, list[ParetoPoint]] = {}
    for p in points:
        runs.setdefault(p.name, []).append(p)
    for name, pts in runs.items():
        if sorted(p.seed for p in pts) != seeds:
            raise ValueError(f"run {name} has seeds {sorted(p.seed for p in pts)}, the sweep {seeds}")
        pts.sort(key=lambda p: p.seed)
    return runs, seeds


def _pairs(run: list[ParetoPoint], ref: list[ParetoPoint]) -> Judgement | None:
    """How far `ref`'s loss lies above `run`'s over their seeds (`below` of the Judgement:
    positive when `run` is lower), paired over the blocks where both kept them; None when
    a loss is not finite."""
    if not all(math.isfinite(p.val_loss) for p in run + ref):
        return None
    diffs = [difference(p, r) for p, r in zip(run, ref, strict=True)]
    return combine([d for d, _, _ in diffs], [se for _, se, _ in diffs], all(pr for *_, pr in diffs))


def _cell(j: Judgement | None) -> str:
    """A paired difference's cell: run minus static, "+0.0120 ± 0.0009 (seeds ± 0.0031)"."""
    if j is None or j.below is None or j.eval_se is None:
        return "-"
    seeds = f" (seeds ± {j.seed_se:.4f})" if j.seed_se is not None else ""
    return f"{-j.below:+.4f} ± {j.eval_se:.4f}{seeds}" + ("" if j.paired else " combined")


def pareto_markdown(points: list[ParetoPoint], target: float, target_name: str, setup: str, along: str = "") -> str:
    """The sweep's table (one row a run, its figures the means over its seeds), the paired
    differences of every run against every static rank, the verdict of each non-static
    run, `along` (along_markdown's table, if any) and the plots. `points` holds every run
    at every seed (ParetoPoint.seed tells them apart)."""
    runs, seeds = _by_run(points)
    n = len(seeds)
    statics = [[p for p in points if p.kind == "static" and p.seed == seed] for seed in seeds]
    static_names = [name for name, pts in runs.items() if pts[0].kind == "static"]
    ref = runs.get(target_name)
    wires = sorted({p.wire for p in statics[0]})
    frontier_wire = wires[0] if len(wires) == 1 else " and ".join(wires)
    loss_head = "final val loss ± SE" if n == 1 else f"final val loss, mean of {n} seeds ± their SD"
    lines = [
        f"| run | wire | {loss_head} | MB sent | bytes vs {target_name} | wall time (s) | "
        f"time to {target:.4f} (s) | vs frontier (bytes) | vs frontier (time) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    judged: dict[str, tuple[Judgement, Judgement]] = {}
    for name, pts in runs.items():
        first = pts[0]
        loss = statistics.fmean(p.val_loss for p in pts)
        spread = first.val_se if n == 1 else statistics.stdev(p.val_loss for p in pts)
        sent = statistics.fmean(p.bytes for p in pts)
        seconds = statistics.fmean(p.seconds for p in pts)
        reached = [p.time_to_target for p in pts]
        ttt = "not reached" if any(math.isinf(t) for t in reached) else f"{statistics.fmean(reached):.1f}"
        if first.kind != "static":
            judged[name] = (judge(pts, statics, "bytes"), judge(pts, statics, "seconds"))
        verdicts = [j.verdict for j in judged[name]] if name in judged else ["frontier", "frontier"]
        if ref:
            ref_bytes = statistics.fmean(p.bytes for p in ref)
            lines.append(f"| {name} | {first.wire} | {loss:.4f} ± {spread:.4f} | {sent / 1e6:.1f} | "
                         f"{sent / ref_bytes:.2f}x | {seconds:.1f} | {ttt} | {verdicts[0]} | {verdicts[1]} |")
        else:
            lines.append(f"| {name} | {first.wire} | {loss:.4f} | {sent / 1e6:.1f} | - | {seconds:.1f} | {ttt} "
                         "| - | - |")
    paired = ""
    if static_names:
        refs = (["none"] if "none" in runs else []) + static_names  # (uncompressed first, where it ran)
        rows = ["| run | " + " | ".join(f"vs {s}" for s in refs) + " |", "|---|" + "---|" * len(refs)]
        for name, pts in runs.items():
            rows.append(f"| {name} | " + " | ".join("—" if s == name else _cell(_pairs(pts, runs[s]))
                                                   for s in refs) + " |")
        paired = (
            "## Paired differences\n\nEach run's final validation loss minus "
            + ("none's (uncompressed) and " if "none" in runs else "") + "each static rank's, over the same "
            "validation blocks: the mean of the per-block differences ± their SE (the paired SE"
            + (f", over {n} seeds: √(Σ SE²)/{n}; \"seeds ±\" is the SE of the mean difference from its spread "
               "over the seeds)" if n > 1 else "; one seed: the spread a run with another seed would add is not "
               "in it)")
            + ". Negative: lower than the run it is set against. \"combined\": a run without block losses, with the "
            "two losses' combined SE.\n\n" + "\n".join(rows) + "\n\n")
    notes = []
    if ref is not None:
        for name, pts in runs.items():
            if pts[0].kind != "dynamic":
                continue
            vs = _pairs(pts, ref)
            sent = statistics.fmean(p.bytes for p in pts) / statistics.fmean(p.bytes for p in ref)
            reach = ("" if vs is None or vs.below is None or vs.margin is None else
                     f"{'reaches' if -vs.below <= vs.margin else 'does not reach'} {target_name}'s final loss within "
                     f"the margin ({-vs.below:+.4f}, margin {vs.margin:.4f}) with {sent:.2f}x its bytes. ")
            on_bytes, on_time = judged[name]
            wire = pts[0].wire
            notes.append(
                f"- {name}: {reach}Against the static frontier ({frontier_wire} wire"
                + (", as this run's" if wire == frontier_wire else f"; this run's is {wire}: not the same wire")
                + f"): {on_bytes.describe()} (loss vs bytes), {on_time.verdict} (loss vs time)."
            )
    for name, pts in runs.items():  # (edgc-diloco against DiLoCo at the same H)
        twin = runs.get(name.removeprefix("edgc-")) if pts[0].kind == "edgc-diloco" else None
        if twin is None:
            continue
        vs = _pairs(pts, twin)
        sent = statistics.fmean(p.bytes for p in pts) / statistics.fmean(p.bytes for p in twin)
        notes.append(f"- {name} against {twin[0].name}: {sent:.3f}x its bytes; final loss {_cell(vs)} "
                     "(the difference, paired).")
    rule = ("the margin is the larger of the gap's paired SE and its seed SE (the seeds' spread over "
            f"√{n})" if n > 1 else "the margin is the gap's paired SE over the validation blocks (one seed: the "
            "verdict is this seed's; --seeds puts the seeds' spread in the margin)")
    return (
        "# edgc bench pareto\n\n" + setup + f" The static frontier's factors travel in {frontier_wire} "
        "(EDGCConfig.wire, as every compressed run's unless --edgc-wire says otherwise after --).\n\n"
        + "\n".join(lines) + "\n\n"
        + ("\n".join(notes) + "\n\n" if notes else "")
        + "The frontier joins the static PowerSGD ranks that no other static rank beats (fewer bytes or less "
        "time and a lower loss); a verdict compares a run's final validation loss with "
        "the frontier's at the same bytes (or wall time), interpolated in log space, block by block; "
        + rule + ". Runs without block losses are judged with the two losses' combined SE. Wall time is the "
        "sum of step times (evaluation excluded).\n\n"
        + paired + along + "![loss vs bytes](pareto-bytes.png)\n![loss vs time](pareto-time.png)\n"
    )


def plot_pareto(points: list[ParetoPoint], out_dir: Path) -> list[Path]:
    """pareto-bytes.png and pareto-time.png: final loss (± SE) against bytes and time; with
    several seeds, each run's means over them (± the SE of the mean loss over the seeds)."""
    runs, seeds = _by_run(points)
    if len(seeds) > 1:
        points = [ParetoPoint(name, pts[0].kind, pts[0].rank, statistics.fmean(p.val_loss for p in pts),
                              statistics.stdev(p.val_loss for p in pts) / math.sqrt(len(pts)),
                              statistics.fmean(p.bytes for p in pts), statistics.fmean(p.seconds for p in pts),
                              math.inf, pts[0].wire) for name, pts in runs.items()]
    paths = []
    for axis, label, scale, fname in (("bytes", "MB sent per replica", 1e-6, "pareto-bytes.png"),
                                      ("seconds", "training wall time (s)", 1.0, "pareto-time.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        statics = sorted((p for p in points if p.kind == "static"), key=lambda p: getattr(p, axis))
        if statics:
            ax.errorbar([getattr(p, axis) * scale for p in statics], [p.val_loss for p in statics],
                        yerr=[p.val_se for p in statics], fmt="o-", color="0.3", capsize=3, label="static PowerSGD")
            for p in statics:
                ax.annotate(f"r{p.rank}", (getattr(p, axis) * scale, p.val_loss), textcoords="offset points",
                            xytext=(4, 4), fontsize=8)
        markers = {"none": "s", "torch": "^", "dynamic": "*", "diloco": "D", "edgc-diloco": "P"}
        for p in points:
            if p.kind == "static":
                continue
            ax.errorbar([getattr(p, axis) * scale], [p.val_loss], yerr=[p.val_se], fmt=markers[p.kind],
                        markersize=12 if p.kind == "dynamic" else 8, capsize=3, label=p.name)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set(xlabel=label, ylabel="final validation loss", title=f"Loss against {label.split(' (')[0]}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / fname
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths
