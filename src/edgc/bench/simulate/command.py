"""The `edgc simulate` subcommand: `add_parser` and `run`."""

from __future__ import annotations

import argparse
import logging

import torch

from edgc.bench.simulate.cluster import ClusterSpec, load_cluster
from edgc.bench.simulate.costs import CostSource
from edgc.bench.simulate.gpu import GPUS, RooflineModel, find_gpu
from edgc.bench.simulate.layout import LAYOUTS
from edgc.bench.simulate.memory import DTYPES, check_layout, memory_report, named_model
from edgc.bench.simulate.model import SimOptions, parse_schedule, simulate
from edgc.bench.simulate.moe import MOE_MODELS, check_tokens, format_moe, moe_traffic
from edgc.bench.simulate.profile import CostProfile, DeviceTimer
from edgc.bench.simulate.report import format_projection
from edgc.models.gpt2 import PRESETS

logger = logging.getLogger(__name__)

__all__ = ["add_parser", "cost_source", "run"]


_EXAMPLES = """\
examples:
  edgc simulate --cluster paper-2.5b                                 the paper's cluster, its GPU's roofline
  edgc simulate --cluster paper-12.1b --gpu H100-SXM5                costs from another GPU's roofline
  edgc simulate --cluster paper-2.5b --device cuda --save-profile p.json
                                                                     costs timed on this GPU, and saved
  edgc simulate --cluster my-cluster.toml --profile p.json           a cluster of your own, saved costs
  edgc simulate --memory --gpt 32,4096 --dp-shard 8                  edgc's state per GPU: a 6.7B GPT, HSDP
  edgc simulate --cluster paper-12.1b --moe mixtral-8x7b --ep 8      a mixture of experts' traffic, by kind"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the `simulate` subcommand to `sub` (run it with `run`)."""
    p = sub.add_parser(
        "simulate", help="project per-step DP sync and training time onto a cluster (α–β model)",
        description="Project none, static PowerSGD and EDGC onto a cluster with an α–β network model and the "
                    "model's real gradient shapes. Compression costs come from a roofline model of the "
                    "cluster's GPU (the default), a saved profile (--profile), or timing on a local device "
                    "(--device).",
        epilog=_EXAMPLES)
    p.add_argument("--cluster", default="paper-2.5b", metavar="NAME|FILE",
                   help="a bundled cluster (paper-2.5b, paper-12.1b) or a TOML file of ClusterSpec fields")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="model preset (default: the cluster's)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the cluster's)")
    p.add_argument("--rank-max", type=int, default=32, help="r_max: static PowerSGD rank and EDGC's upper bound")
    p.add_argument("--rank-min", type=int, default=None, help="r_min (default: rank-max // 4)")
    p.add_argument("--warmup-fraction", type=float, default=0.1, help="share of steps trained uncompressed")
    p.add_argument("--tp-layout", choices=LAYOUTS, default="vocab",
                   help="how tensor parallelism splits the model: vocab (as edgc train --tp: the token embedding and "
                        "the head's copy on the last stage split on the vocabulary), whole (as --no-vocab-parallel: "
                        "both whole on every TP rank) or megatron (the vocabulary split, the head's copy left out)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--edgc-mean-rank", type=float, default=None,
                       help="EDGC stage-0 rank held constant after warm-up")
    group.add_argument("--edgc-schedule", default=None,
                       help='EDGC stage-0 rank as "FRACTION:RANK,..." knots, e.g. "0.1:32,1.0:8" '
                            "(default: warm-up, then r_max falling linearly to r_min)")
    costs = p.add_mutually_exclusive_group()
    costs.add_argument("--gpu", default=None, metavar="NAME",
                       help=f"cost compression with the roofline model of this GPU instead of the cluster's "
                            f"({', '.join(GPUS)})")
    costs.add_argument("--device", choices=("cpu", "cuda"), default=None,
                       help="time the compression on this local device instead of modelling it; cpu must be "
                            "asked for, and its timings are flagged when projected onto a GPU cluster")
    p.add_argument("--profile", metavar="FILE",
                   help="load compression costs saved by --save-profile; missing ones are filled from --gpu "
                        "or --device when given, else it is an error")
    p.add_argument("--save-profile", metavar="FILE",
                   help="write the (unscaled) cost profile, with where its numbers came from, as JSON")
    p.add_argument("--compute-scale", type=float, default=1.0,
                   help="multiply compression/entropy times by this (default: 1.0, as modelled or measured)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per shape and rank (--device only)")
    moe = p.add_argument_group("mixture of experts", "--moe prints a step's traffic per GPU of a mixture of "
                               "experts on the cluster's GPUs, by kind, and nothing else (docs/moe.md)")
    moe.add_argument("--moe", choices=sorted(MOE_MODELS), default=None,
                     help="a public mixture-of-experts configuration, trained data-parallel on every GPU of the "
                          "cluster")
    moe.add_argument("--ep", type=int, default=8, help="expert-parallel GPUs (inside a node up to gpus_per_node)")
    moe.add_argument("--moe-tokens", type=int, default=65536, help="tokens a GPU a step")
    mem = p.add_argument_group("memory", "--memory prints the bytes edgc's hook state takes per GPU, and nothing else")
    mem.add_argument("--memory", action="store_true",
                     help="print the hook state's bytes per GPU for the model and layout (no projection)")
    mem.add_argument("--gpt", metavar="LAYERS,WIDTH", default=None,
                     help="count a GPT-2-shaped model of this depth and width instead of --preset (--memory only)")
    mem.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (default: the cluster's)")
    mem.add_argument("--pp", type=int, default=None, help="pipeline stages (default: the cluster's)")
    mem.add_argument("--dp-shard", type=int, default=1, help="FSDP2 shard group size (1: DDP)")
    mem.add_argument("--grad-dtype", choices=sorted(DTYPES), default=None,
                     help="the gradients' dtype (default: the cluster's, 2-byte gradients as bf16)")


def _memory(args: argparse.Namespace, cluster: ClusterSpec) -> int:
    """`--memory`: print the hook state's bytes per GPU (edgc.bench.simulate.memory); returns 0."""
    tp = cluster.tp if args.tp is None else args.tp
    pp = cluster.pp if args.pp is None else args.pp
    check_layout(tp, pp, args.dp_shard)
    dtype = args.grad_dtype or ("float32" if cluster.grad_bytes == 4 else "bf16")
    model, name = named_model(args.preset or cluster.preset, args.gpt)
    print(memory_report(model, name, dtype, tp, pp, args.dp_shard, args.rank_max, args.tp_layout), end="")
    return 0


def _timing_dtype(device: str, cluster: ClusterSpec) -> str:
    """The gradient dtype to time with: the cluster's (its GPU's half type for 2-byte gradients).

    The compression arithmetic itself runs in float32 either way (edgc.comm.hook's
    working dtype), so only the conversions are in the half type.
    """
    if cluster.grad_bytes == 4:
        return "float32"
    gpu = cluster.gpu_spec
    if gpu is not None:
        return gpu.half_dtype
    if device == "cuda" and not torch.cuda.is_bf16_supported():
        return "float16"
    return "bfloat16"


def cost_source(args: argparse.Namespace, cluster: ClusterSpec) -> CostSource | None:
    """Return what fills the cost profile, from the parsed flags and the cluster.

    --device: a DeviceTimer (never chosen silently); --gpu: that GPU's roofline model; else,
    without --profile, the roofline model of the cluster's GPU; with --profile only: None
    (the file must hold every cost). Raises ValueError when there is nothing to cost with.
    """
    if args.device is not None:
        if args.device == "cpu" and cluster.gpu is not None:
            logger.warning("timing compression on this CPU and projecting it onto %s GPUs, as asked", cluster.gpu)
        return DeviceTimer(args.device, dtype=_timing_dtype(args.device, cluster), repeats=args.repeats)
    if args.gpu is not None:
        return RooflineModel(gpu=find_gpu(args.gpu), element_bytes=cluster.grad_bytes)
    if args.profile:
        return None
    if cluster.gpu is None:
        raise ValueError(
            f"cluster {cluster.name!r} names no GPU, so there is no roofline model to cost compression with: "
            f'add gpu = "H100" (or {", ".join(GPUS)}) to its file, give --gpu NAME, load a profile with '
            "--profile FILE, or time it here with --device cuda (or, explicitly, --device cpu)")
    return RooflineModel(gpu=find_gpu(cluster.gpu), element_bytes=cluster.grad_bytes)


def run(args: argparse.Namespace) -> int:
    """Run `edgc simulate` from parsed arguments: print the markdown report; returns 0.

    Writes the cost profile to --save-profile when given. Raises ValueError or
    FileNotFoundError for bad input (the CLI prints them).
    """
    cluster = load_cluster(args.cluster)
    if args.moe is not None:
        traffic = moe_traffic(MOE_MODELS[args.moe], cluster, ep=args.ep, tokens=check_tokens(args.moe_tokens),
                              rank=args.rank_max)
        print(format_moe([traffic]), end="")
        return 0
    if PRESETS[args.preset or cluster.preset].n_expert:
        raise ValueError(f"edgc simulate projects dense models; {args.preset or cluster.preset} has experts: use "
                         "--moe NAME for a mixture of experts' traffic by kind (docs/moe.md)")
    if args.memory:
        return _memory(args, cluster)
    if args.gpt is not None or args.tp is not None or args.pp is not None or args.dp_shard != 1:
        raise ValueError("--gpt, --tp, --pp and --dp-shard go with --memory "
                         "(the projection takes the cluster's layout)")
    overrides = {k: v for k, v in (("preset", args.preset), ("steps", args.steps)) if v is not None}
    if overrides:
        cluster = ClusterSpec.from_dict({**cluster.__dict__, **overrides})
    schedule: tuple[tuple[float, float], ...] | None = None
    if args.edgc_mean_rank is not None:
        schedule = ((args.warmup_fraction, args.edgc_mean_rank), (1.0, args.edgc_mean_rank))
    elif args.edgc_schedule:
        schedule = parse_schedule(args.edgc_schedule)
    opts = SimOptions(rank_max=args.rank_max, rank_min=args.rank_min, warmup_fraction=args.warmup_fraction,
                      edgc_schedule=schedule, tp_layout=args.tp_layout)
    profile = CostProfile(cost_source(args, cluster), compute_scale=args.compute_scale)
    if args.profile:
        profile.load(args.profile)
    proj = simulate(cluster, profile, opts)
    if profile.measured:
        print(f"(measured {profile.measured} cost entries on {args.device} in {profile.fill_seconds:.1f}s)")
    if args.save_profile:
        profile.save(args.save_profile)
        print(f"cost profile: {args.save_profile}")
    print(format_projection(proj, profile), end="")
    return 0
