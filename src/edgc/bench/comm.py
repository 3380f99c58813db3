"""`edgc bench comm`: one step's gradient synchronisation, method by method, on real links.

The gradient set has the parameter shapes of a model preset (built on the meta device,
then filled with random values), cut into 25 MB buckets in reverse parameter order as DDP
does. Each method's hook is called on those buckets exactly as DDP would call it:

- none: all-reduce of every bucket (DDP's default behaviour);
- torch-powersgd: torch's powerSGD_hook at rank r (waited per bucket, see comm.baselines);
- powersgd: our compressor, static rank r;
- edgc r=k: our hook with the CQM policy held at rank k, entropy sampling included, for k
  across [r_min, r_max], the range EDGC moves in.

Our two rows come once per `--sync-modes` entry (EDGCConfig.sync_mode), "(whole-step)"
appended to the name of the whole-step ones. The buckets come back to back here, with no
backward pass between them to hide communication behind, so the two modes differ only in
how the bytes are cut into collectives; `edgc bench train` measures the overlap.

Reported: bytes handed to collectives per replica, sync time per step (median, slowest
replica), compression compute time, and efficiency against the physical limit of a ring
all-reduce of those bytes, 2(N-1)/N * bytes / bandwidth.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from edgc.bench.cluster import run_on_cluster
from edgc.bench.netns import Cluster, NetnsUnavailable
from edgc.comm import EDGCState, edgc_hook
from edgc.comm.baselines import (
    AllReduceState,
    TorchPowerSGDState,
    allreduce_hook,
    torch_powersgd_hook,
)
from edgc.comm.buckets import FlatBucket
from edgc.config import SYNC_MODES, EDGCConfig
from edgc.models import PRESETS, build_model
from edgc.train.launch import end_process_group

__all__ = ["add_parser", "ring_allreduce_seconds", "run"]


def ring_allreduce_seconds(nbytes: float, world: int, bits_per_second: float, latency: float = 0.0) -> float:
    """Ring all-reduce time: 2(N-1) latency terms plus 2(N-1)/N * bytes / bandwidth."""
    if world <= 1:
        return 0.0
    return 2 * (world - 1) * latency + 2 * (world - 1) / world * nbytes * 8 / bits_per_second


def _buckets(shapes: list[torch.Size], cap_bytes: int, seed: int) -> tuple[list[FlatBucket], list[torch.Tensor]]:
    """Random gradients of `shapes` in DDP-like buckets (reverse order, ~cap_bytes each)."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.empty(s) for s in shapes]
    groups: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in reversed(params):
        if groups[-1] and size + p.numel() * 4 > cap_bytes:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += p.numel() * 4
    buckets = []
    for i, g in enumerate(groups):
        buf = torch.randn(sum(p.numel() for p in g), generator=gen) * 1e-3
        buckets.append(FlatBucket(i, buf, g, i == len(groups) - 1))
    originals = [b.buffer().clone() for b in buckets]
    return buckets, originals


_WHOLE = " (whole-step)"


def _methods(r: int, r_min: int, modes: list[str]) -> list[tuple[str, Any]]:
    ranks = sorted({r_min, max(r_min, r // 2), r})
    out: list[tuple[str, Any]] = [("none", None), ("torch-powersgd", None)]
    for mode in modes:
        suffix = _WHOLE if mode == "whole-step" else ""
        out += [(f"powersgd{suffix}", None)] + [(f"edgc r={k}{suffix}", k) for k in ranks]
    return out


def _make(name: str, k: int | None, args: argparse.Namespace):
    if name == "none":
        return AllReduceState(None), allreduce_hook
    if name == "torch-powersgd":
        return TorchPowerSGDState(None, rank=args.rank, start_iter=1), torch_powersgd_hook
    mode = "whole-step" if name.endswith(_WHOLE) else "pipelined"
    if name.startswith("powersgd"):
        cfg = EDGCConfig(policy="static", max_rank=args.rank, warmup_steps=0, sync_mode=mode,
                         min_unit_mb=args.min_unit_mb, long_rank_factor=1.0)  # (PowerSGD: one rank)
    else:
        cfg = EDGCConfig(policy="cqm", max_rank=k, min_rank=k, warmup_steps=0, window=1000,
                         iteration_sample_rate=args.alpha, sync_mode=mode, min_unit_mb=args.min_unit_mb)
    return EDGCState(None, cfg), edgc_hook


def worker(args: argparse.Namespace) -> None:
    """One replica: time every method's sync; rank 0 writes the results as JSON."""
    dist.init_process_group("gloo")
    rows = _measure(args)
    if dist.get_rank() == 0:
        Path(args.worker_out).write_text(json.dumps(rows))
    end_process_group()  # the states and their gloo work are out of scope by now


def _measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    shapes = [p.shape for p in build_model(args.preset, vocab_size=args.vocab, device="meta").parameters()]
    buckets, originals = _buckets(shapes, int(args.bucket_mb * 2**20), seed=rank)
    r_min = max(1, args.rank // 4)
    rows = []
    for name, k in _methods(args.rank, r_min, _sync_modes(args.sync_modes)):
        state, hook = _make(name, k, args)
        times, stats_before = [], None
        for step in range(args.warmup + args.steps):
            for b, o in zip(buckets, originals, strict=True):
                b.buffer().copy_(o)
            if step == args.warmup:
                stats_before = state.stats()
            dist.barrier()
            t0 = time.perf_counter()
            futures = [hook(state, b) for b in buckets]
            for f in futures:
                f.wait()
            t = torch.tensor([time.perf_counter() - t0])
            # collective (benchmark only): the slowest replica's time
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if step >= args.warmup:
                times.append(float(t))
        stats = state.stats()
        assert stats_before is not None, "--steps must be at least 1"  # (taken before the first measured step)
        rows.append({
            "method": name, "rank": k if k is not None else (0 if name == "none" else args.rank),
            "bytes": (stats.bytes_sent - stats_before.bytes_sent) / args.steps,
            "bytes_uncompressed": (stats.bytes_uncompressed - stats_before.bytes_uncompressed) / args.steps,
            "sync_s": statistics.median(times),
            "compress_s": (stats.compress_seconds - stats_before.compress_seconds) / args.steps,
            "entropy_s": (stats.entropy_seconds - stats_before.entropy_seconds) / args.steps,
        })
    return rows


def format_table(rows: list[dict[str, Any]], world: int, bits_per_second: float | None) -> str:
    base = next(r for r in rows if r["method"] == "none")
    head = "| method | rank | MB/step | sync (ms) | vs none | compress (ms) | entropy (ms) |"
    sep = "|---|---|---|---|---|---|---|"
    if bits_per_second:
        head += " ring limit (ms) | efficiency |"
        sep += "---|---|"
    lines = [head, sep]
    for r in rows:
        # torch's hook mixes its arithmetic with its waits: no separate compression time
        compress = "n/a" if r["method"] == "torch-powersgd" else f"{r['compress_s'] * 1e3:.1f}"
        line = (f"| {r['method']} | {r['rank'] or '-'} | {r['bytes'] / 1e6:.3f} | {r['sync_s'] * 1e3:.1f} | "
                f"{r['sync_s'] / base['sync_s']:.2f} | {compress} | {r['entropy_s'] * 1e3:.2f} |")
        if bits_per_second:
            limit = ring_allreduce_seconds(r["bytes"], world, bits_per_second)
            line += f" {limit * 1e3:.1f} | {limit / r['sync_s']:.0%} |"
        lines.append(line)
    return "\n".join(lines) + "\n"


_DESCRIPTION = """\
Time one step's gradient sync per method: the gradients of a model preset's shapes, cut into \
DDP's buckets, handed to each method's hook as DDP would, back to back, on an emulated \
cluster (one network namespace per worker, every link limited with tc; needs root and \
iproute2, or --loopback for 127.0.0.1 without limits). Methods: none, torch-powersgd, our \
powersgd at r_max, and edgc held at ranks across [r_max/4, r_max], ours once per \
--sync-modes entry. Prints bytes per step, the median sync time of the slowest replica, the \
compression and entropy time, and the efficiency against a ring all-reduce at the link's \
rate."""

_EXAMPLES = """\
examples:
  edgc bench comm --preset gpt2-124m --nproc 4 --bandwidth 200mbit   real slow links
  edgc bench comm --loopback --nproc 2 --steps 3                     a quick look, no namespaces
  edgc bench comm --sync-modes pipelined --min-unit-mb 4             units of at least 4 MB"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("comm", help="time one step's gradient sync per method on an emulated cluster",
                       description=_DESCRIPTION, epilog=_EXAMPLES)
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                   help="model preset whose parameter shapes the gradients have (built on the meta device)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the preset's)")
    p.add_argument("--nproc", type=int, default=4, help="workers, one per emulated node")
    p.add_argument("--bandwidth", default="200mbit", metavar="RATE",
                   help="per-link rate, each direction (tc syntax: 200mbit, 1gbit)")
    p.add_argument("--loopback", action="store_true", help="no namespaces or limits: 127.0.0.1")
    p.add_argument("--rank", type=int, default=32, help="r_max (EDGC moves in [r_max/4, r_max])")
    p.add_argument("--alpha", type=float, default=0.1, help="EDGC iteration sampling rate")
    p.add_argument("--steps", type=int, default=10,
                   help="measured steps (at least 1/alpha to include an entropy sample)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per method before the measured ones")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size in MB (DDP's bucket_cap_mb)")
    p.add_argument("--sync-modes", default="pipelined,whole-step",
                   help="our hook's modes to time (EDGCConfig.sync_mode), comma-separated")
    p.add_argument("--min-unit-mb", type=float, default=0.0,
                   help="EDGCConfig.min_unit_mb of our pipelined rows: merge buckets into units of at least this "
                        "many MB on the wire (0: every bucket a unit)")
    p.add_argument("--out", default=None, metavar="FILE", help="write the markdown table here too")
    p.add_argument("--timeout", type=float, default=1800,
                   help="seconds the whole measurement may take before its workers are killed")
    p.add_argument("--worker-out", help=argparse.SUPPRESS)


def _sync_modes(text: str) -> list[str]:
    """The --sync-modes list; raises ValueError naming a mode that is not one."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in SYNC_MODES]
    if unknown or not modes:
        raise ValueError(f"--sync-modes {text!r}: choose from {', '.join(SYNC_MODES)}")
    return modes


def run(args: argparse.Namespace) -> int:
    # (both checked before any worker starts: a ValueError naming the option)
    _sync_modes(args.sync_modes)
    EDGCConfig(min_unit_mb=args.min_unit_mb)
    if args.worker_out:
        worker(args)
        return 0
    cluster = Cluster(args.nproc, None if args.loopback else args.bandwidth)
    if not args.loopback:
        try:
            Cluster.check()
        except NetnsUnavailable as exc:
            raise ValueError(str(exc)) from None
    out_json = Path(os.path.abspath(f".edgc-bench-comm-{os.getpid()}.json"))
    argv = ["bench", "comm", "--preset", args.preset, "--rank", str(args.rank), "--alpha", str(args.alpha),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--bucket-mb", str(args.bucket_mb),
            "--sync-modes", args.sync_modes, "--min-unit-mb", str(args.min_unit_mb), "--worker-out", str(out_json)]
    if args.vocab:
        argv += ["--vocab", str(args.vocab)]
    try:
        with cluster:
            run_on_cluster(cluster, argv, timeout=args.timeout)
        rows = json.loads(out_json.read_text())
    finally:
        out_json.unlink(missing_ok=True)
    link = "loopback (no limit)" if args.loopback else f"{args.bandwidth} per link, each direction"
    model = build_model(args.preset, vocab_size=args.vocab, device="meta")
    n_params = sum(math.prod(p.shape) for p in model.parameters())
    units = f", pipelined units of at least {args.min_unit_mb:g} MB on the wire" if args.min_unit_mb else ""
    title = (f"edgc bench comm: {args.preset} ({n_params / 1e6:.1f}M parameters), {args.nproc} workers, {link}; "
             f"{args.bucket_mb:g} MB buckets{units}; median of {args.steps} steps; "
             f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}\n\n")
    text = title + format_table(rows, args.nproc, cluster.bits_per_second)
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    return 0
