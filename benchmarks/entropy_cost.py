"""What the Gradient Data Sampler saves: entropy on the full gradient against GDS sampling.

The paper reports that GDS cuts the time spent estimating entropy by about 94%
(EDGC_SPEC.md, "Component 1"). This script measures that on this machine:

(a) full:         the histogram entropy of the whole flattened gradient, every step;
    sampled only: the same estimate on every round(1/β)-th element (GSR β), every step;
(b) GDS:          the sampled estimate, but only on every round(1/α)-th step (ISR α), timed
                  over a loop of steps that asks `is_sampled_step` each step, so the
                  amortisation is measured rather than assumed.

The gradient is one flat buffer (as in a DDP bucket, or the release's flattened buffer)
viewed as the parameter shapes of a 12-layer, 768-hidden GPT-2 block stack (85M elements,
embeddings excluded), or `--numel` elements. Its values are random normal (the cost
hardly depends on them). This is a benchmark, not a test: nothing is asserted.

    python3 benchmarks/entropy_cost.py [--alpha 0.1] [--beta 0.25] [--bins 1000]
                                       [--repeats 5] [--numel N] [--device cpu]
"""

from __future__ import annotations

import argparse
import math
import platform
import time
from collections.abc import Callable

import torch

from edgc.entropy import histogram_entropy, is_sampled_step, sample_gradient, sample_stride


def gpt2_block_shapes(layers: int = 12, hidden: int = 768) -> list[tuple[int, ...]]:
    """Return the parameter shapes of `layers` GPT-2 blocks (HF Conv1D layout, in × out)."""
    modules = [  # (weight shape, bias shape) of each module in one block
        ((hidden,), (hidden,)),  # ln_1
        ((hidden, 3 * hidden), (3 * hidden,)),  # attn.c_attn
        ((hidden, hidden), (hidden,)),  # attn.c_proj
        ((hidden,), (hidden,)),  # ln_2
        ((hidden, 4 * hidden), (4 * hidden,)),  # mlp.c_fc
        ((4 * hidden, hidden), (hidden,)),  # mlp.c_proj
    ]
    return [shape for _ in range(layers) for pair in modules for shape in pair]


def shapes_for_numel(numel: int, hidden: int = 768) -> list[tuple[int, ...]]:
    """Return hidden × 4·hidden matrices totalling `numel` elements, plus a remainder vector."""
    block = hidden * 4 * hidden
    shapes: list[tuple[int, ...]] = [(hidden, 4 * hidden)] * (numel // block)
    if numel % block:
        shapes.append((numel % block,))
    return shapes


def build_gradient(
    shapes: list[tuple[int, ...]], device: torch.device, seed: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Return (flat buffer, views of it in `shapes`), filled with N(0, 1e-3²) values."""
    total = sum(math.prod(s) for s in shapes)
    gen = torch.Generator(device=device).manual_seed(seed)
    flat = torch.randn(total, generator=gen, device=device) * 1e-3  # (total,)
    views, offset = [], 0
    for s in shapes:
        n = math.prod(s)
        views.append(flat[offset : offset + n].view(s))
        offset += n
    return flat, views


def timed_interleaved(fns: list[Callable[[], object]], repeats: int, sync: Callable[[], None]) -> list[float]:
    """Return the least wall time in seconds over `repeats` calls of each fn.

    The functions take turns within each repeat, so load from other processes on a shared
    machine falls on all of them alike, and the minimum is the least disturbed run (the
    `timeit` convention). Each fn is called once untimed first, to warm caches and the
    allocator.
    """
    for fn in fns:
        fn()
    sync()
    best = [math.inf] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            sync()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def _load_average() -> str:
    """Return the 1-minute load average as text ("n/a" off Linux): other work skews timings."""
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--alpha", type=float, default=0.1, help="iteration sampling rate α (paper: 0.1)")
    parser.add_argument("--beta", type=float, default=0.25, help="gradient sampling rate β (paper: 0.25)")
    parser.add_argument("--bins", type=int, default=1000, help="histogram bins (release: 1000)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls of each estimate")
    parser.add_argument("--numel", type=int, default=None, help="gradient size; default: GPT-2 small blocks (85M)")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    shapes = shapes_for_numel(args.numel) if args.numel else gpt2_block_shapes()
    flat, views = build_gradient(shapes, device, args.seed)
    k_alpha = sample_stride(args.alpha)

    def full() -> float:
        return histogram_entropy(flat, bins=args.bins)

    def sampled() -> float:
        # As a DDP hook sees it: one flat bucket buffer, sampled with one strided copy.
        return histogram_entropy(sample_gradient([flat], args.beta), bins=args.bins)

    def sampled_per_tensor() -> float:
        # The same elements when the shapes are multiples of k, but one copy per tensor.
        return histogram_entropy(sample_gradient(views, args.beta), bins=args.bins)

    def gds_steps() -> None:
        # One α period of the GDS: the estimate runs only on sampled steps. Timing whole
        # periods makes the amortisation measured, not assumed.
        for step in range(1, k_alpha + 1):
            if is_sampled_step(step, args.alpha):
                sampled()

    load_before = _load_average()
    t_full, t_sampled, t_per_tensor, t_gds_period = timed_interleaved(
        [full, sampled, sampled_per_tensor, gds_steps], args.repeats, sync
    )
    t_gds = t_gds_period / k_alpha  # per step
    load_after = _load_average()

    if device.type == "cuda":
        processor = torch.cuda.get_device_name(device)
    else:
        processor = platform.processor() or platform.machine()
    print(
        f"gradient: {flat.numel():,} elements in {len(views)} tensors, {flat.dtype}, device {device}"
        f" ({processor}, torch {torch.__version__}, {torch.get_num_threads()} threads)"
    )
    print(
        f"alpha = {args.alpha} (every {k_alpha} steps), beta = {args.beta} (every {sample_stride(args.beta)}"
        f" elements), bins = {args.bins}, best of {args.repeats} interleaved repeats"
    )
    print(f"1-minute load average before / after: {load_before} / {load_after}\n")
    print("| estimate | time per step (ms) | vs full | saved |")
    print("|---|---:|---:|---:|")
    for name, t in [
        ("(a) full gradient, every step", t_full),
        (f"sampled only (β = {args.beta}), every step", t_sampled),
        (f"sampled only, per tensor ({len(views)} copies), every step", t_per_tensor),
        (f"(b) GDS (β = {args.beta}, α = {args.alpha})", t_gds),
    ]:
        print(f"| {name} | {t * 1e3:.2f} | {t / t_full:.1%} | {1 - t / t_full:.1%} |")
    print(f"\nGDS saves {1 - t_gds / t_full:.1%} of the full estimate's time (paper: about 94%).")


if __name__ == "__main__":
    main()
