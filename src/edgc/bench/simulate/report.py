"""The markdown report of `edgc simulate`: where the costs come from, the table, the assumptions."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from edgc.bench.simulate.cluster import ClusterSpec
from edgc.bench.simulate.gpu import RooflineModel, match_gpu
from edgc.bench.simulate.model import (
    PAPER_COMM_REDUCTION,
    PAPER_TIME_REDUCTION,
    Projection,
    compressed_matrices,
    wire_crossover_rank,
)
from edgc.bench.simulate.profile import CostProfile, DeviceTimer

__all__ = ["CostOrigin", "cost_origins", "format_projection"]


#: The report's line on each tensor-parallel layout (edgc.bench.simulate.layout.LAYOUTS).
_TP_LAYOUT_NOTES = {
    "vocab": "the token embedding split on the vocabulary by ceil(V/tp) (without Megatron's padding) and the "
             "head's copy of it, split alike, synced by the last stage, as edgc train --tp does.",
    "whole": "the token embedding whole on every TP rank and the head's copy of it synced by the last stage, as "
             "edgc train --tp --no-vocab-parallel does.",
    "megatron": "vocabulary split by ceil(V/tp) without Megatron's padding; tied head counted once on stage 0.",
}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h"


def _less(value: float, base: float) -> str:
    """"−12.3%" (less than base) or "+4.0%" (more)."""
    if base == 0:
        return "n/a"
    return f"{(value - base) / base * 100:+.1f}%"


def _ranks(ranks: Sequence[int | None]) -> str:
    return "/".join("unc" if r is None else str(r) for r in ranks)


@dataclass(frozen=True)
class CostOrigin:
    """Where one part of a cost profile came from, as the report describes it."""

    kind: str
    """"roofline", "measured-gpu" or "measured-cpu"."""
    name: str
    """The GPU of the roofline model, or the device the costs were timed on."""
    detail: str
    """The assumptions, or how the timing was done."""


def cost_origins(profile: CostProfile) -> list[CostOrigin]:
    """Return the origins of `profile`'s numbers, roofline models first."""
    out = []
    for origin, detail in profile.origins.items():
        kind, _, name = origin.partition(":")
        if kind == "roofline":
            out.append(CostOrigin("roofline", name, detail))
        elif name.startswith("cpu"):
            out.append(CostOrigin("measured-cpu", name, detail))
        else:
            out.append(CostOrigin("measured-gpu", name.removeprefix("cuda: "), detail))
    return sorted(out, key=lambda o: (o.kind != "roofline", o.kind, o.name))


def _cost_lines(cluster: ClusterSpec, profile: CostProfile) -> list[str]:
    """The report's opening lines: what the compression costs are, and any mismatch with the cluster."""
    gpu = cluster.gpu_spec
    lines = []
    origins = cost_origins(profile)
    if not origins:
        lines.append("- compression and entropy costs: given directly to the profile (no recorded origin)")
    for o in origins:
        if o.kind == "roofline":
            lines.append(f"- compression and entropy costs: {o.detail}")
            if gpu is not None and gpu.name != o.name:
                lines.append(f"  - NOTE: the cluster's GPU is {gpu.name}, but these costs model the {o.name}.")
        elif o.kind == "measured-gpu":
            lines.append(f"- compression and entropy costs: measured on {o.name}: {o.detail}")
            matched = match_gpu(o.name)
            if gpu is not None and (matched is None or matched.name != gpu.name):
                lines.append(f"  - NOTE: the cluster's GPU is {gpu.name}, but these costs were measured on "
                             f"{o.name}: the compression below runs at the measured GPU's speed, not the "
                             f"{gpu.name}'s.")
        else:
            lines.append(f"- compression and entropy costs: measured on this machine's CPU, {o.name}: {o.detail}")
            if gpu is not None:
                lines.append(
                    f"  - **WARNING: CPU timings are projected onto a cluster of {gpu.name} GPUs.** A CPU is "
                    "far slower at this arithmetic than a GPU, so every compressed method below looks slower "
                    f"than it would be on the cluster. Leave out --device cpu to use the roofline model of "
                    f"the {gpu.name}, or measure on a GPU with --device cuda.")
    if profile.compute_scale != 1:
        lines.append(f"- compression and entropy times multiplied by --compute-scale {profile.compute_scale:g} "
                     "(an assumption about the target hardware)")
    return lines


def _arithmetic_note(profile: CostProfile) -> str:
    """The assumption bullet about how the compression arithmetic was costed."""
    kinds = {o.kind for o in cost_origins(profile)}
    parts = []
    if "roofline" in kinds:
        parts.append(
            "modelled (roofline, see the top) for the operations edgc's round runs in the compress phase, "
            "each launched once per unit of the step (EDGCConfig.max_units): M = G + E gathered from the "
            "buckets for each of its three reads, P = MQ, P to the wire dtype and back, the orthogonalisation "
            "(Cholesky-QR2 in float64, 13 launches a batch, its flops at the FP64 rate), Q = MᵀP, Q to the "
            "wire dtype and back, keeping Q, E = M - PQᵀ in one baddbmm, the average and its copy back; each "
            "kernel or host sync pays one launch latency, a multi-tensor op counts as one, kernels do not "
            "overlap, and traffic that may stay in L2 is counted at HBM bandwidth; a shape's cost is "
            "modelled at its largest batch on one stage; the GDS step is the non-finite check, the strided "
            "sample and the estimator")
    if kinds & {"measured-gpu", "measured-cpu"}:
        batch = (f"up to {profile.source.max_batch}" if isinstance(profile.source, DeviceTimer)
                 and profile.source.max_batch is not None else "the")
        parts.append(
            f"timed per (m, n, r) on {batch} batch of same-shape matrices (the same operations), scaled by "
            "count and interpolated linearly between the timed ranks; the GDS step timed at two gradient "
            "sizes and fitted as fixed + per-element")
    if not parts:
        parts.append("as given in the profile")
    scale = ("" if profile.compute_scale == 1
             else f"; all multiplied by --compute-scale {profile.compute_scale:g}")
    return "- compression arithmetic: " + "; ".join(parts) + scale + "."


def _breakdown(proj: Projection, model: RooflineModel) -> list[str]:
    """A table of the roofline cost of one compressed step at r_max on the largest stage."""
    o = proj.options
    p = max(range(len(proj.stages)), key=lambda s: proj.stages[s].numel)
    stage = proj.stages[p]
    mats, _ = compressed_matrices(stage, o)
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for (m, n), count in sorted(mats.items()):
        for op in model.lowrank_ops(m, n, o.rank_max, count):
            t = totals[op.name]
            t[0] += op.flops
            t[1] += op.bytes
            t[2] += op.launches
            t[3] += model.seconds(op)
    gds = model.gds_ops(stage.numel, o.gradient_sample_rate, o.entropy_estimator, o.bins)
    lines = [
        "",
        (f"Roofline cost of one PowerSGD round at r = {o.rank_max} on stage {p} ({sum(mats.values())} "
         f"matrices in {len(mats)} same-shape batches, {model.dtype}), {model.gpu.name} model:"),
        "",
        "| operation | GFLOP | MB moved | launches | time |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, (flops, nbytes, launches, seconds) in totals.items():
        lines.append(f"| {name} | {flops / 1e9:.2f} | {nbytes / 1e6:.1f} | {launches:.0f} | {_ms(seconds)} |")
    lines.append(f"| **total** | {sum(t[0] for t in totals.values()) / 1e9:.2f} | "
                 f"{sum(t[1] for t in totals.values()) / 1e6:.1f} | {sum(t[2] for t in totals.values()):.0f} | "
                 f"**{_ms(sum(t[3] for t in totals.values()))}** |")
    lines += [
        "",
        (f"One GDS entropy step on that stage ({stage.numel / 1e6:.1f}M elements, β = {o.gradient_sample_rate:g}, "
         f"{o.entropy_estimator}): {_ms(model.total_seconds(gds))}, run every {1 / o.iteration_sample_rate:g} steps."),
    ]
    return lines


def format_projection(proj: Projection, profile: CostProfile) -> str:
    """Return the markdown report: cost origin, setup, table, paper figures, assumptions."""
    c, o = proj.cluster, proj.options
    base = proj.method("none")
    gbit = 8e-9
    flops = f" (6 x params x tokens / ({c.gpus} x {c.achieved_flops / 1e12:g} TFLOP/s))" if c.achieved_flops else ""
    lines = [
        f"## edgc simulate: {c.preset} ({proj.n_params / 1e9:.2f}B parameters) on {c.name}",
        "",
        *_cost_lines(c, profile),
        (f"- layout: {c.gpus} GPUs{f' ({c.gpu})' if c.gpu else ''} = TP{c.tp} x PP{c.pp} x DP{c.dp}, "
         f"{c.gpus_per_node} GPUs/node; {c.micro_batches} micro-batches of {c.micro_batch} x {c.seq_len} tokens "
         f"per pipeline (global batch {c.global_batch}), {c.steps:,} steps"),
        (f"- network (α–β): {c.bandwidth * gbit:g} Gbit/s per node shared by "
         f"{c.link_sharing or c.gpus_per_node} rings -> {c.ring_bandwidth * gbit:g} Gbit/s "
         f"({c.ring_bandwidth / 1e9:.3g} GB/s) per DP ring of N={c.dp}, α = {c.latency * 1e6:g} µs"),
        f"- compute: {proj.compute_s:.3f} s/step{flops}; t_mb (backward per micro-batch) = {_ms(proj.t_mb)}",
        (f"- gradient per GPU by stage: {', '.join(f'{s.numel / 1e6:.1f}M' for s in proj.stages)} elements "
         f"x {c.grad_bytes} bytes"),
        (f"- ranks: r_max {o.rank_max}, r_min {o.resolved_rank_min}; EDGC stage-0 schedule "
         f"{', '.join(f'{f:g}:{r:g}' for f, r in o.schedule)} (fraction:rank, uncompressed before the first)"),
        "",
        ("| method | stage ranks (first -> last step) | wire, crit. stage | compress+entropy | DP sync exposed "
         "| vs none | step time | vs none | training time | vs none |"),
        "|" + "---|" * 10,
    ]
    for m in proj.methods:
        ranks = "-" if m.method == "none" else _ranks(m.first.ranks)
        if m.last.ranks != m.first.ranks:
            ranks += " -> " + _ranks(m.last.ranks)
        vs = (lambda a, b: "-") if m is base else _less
        lines.append(
            f"| {m.label} | {ranks} | {_ms(m.wire_s)} | {_ms(m.overhead_s)} | {_ms(m.sync_s)} | "
            f"{vs(m.sync_s, base.sync_s)} | {m.step_s:.3f} s | {vs(m.step_s, base.step_s)} | "
            f"{_hours(m.total_s)} | {vs(m.total_s, base.total_s)} |"
        )
    crossover = wire_crossover_rank(proj.stages[0], c, o)
    if o.rank_max < crossover:
        dac_note = (f"- DAC rule: r_max = {o.rank_max} is fixed, below the rank ({crossover}) at which stage 0's "
                    "compressed wire time reaches the uncompressed one (where the release's calibration would "
                    "put r_max); there the spec's rule 'r_p > r_max -> uncompressed' can send a stage "
                    "uncompressed past its slack. 'DAC capped at r_max' runs such stages at r_max instead.")
    else:
        dac_note = (f"- DAC rule: r_max = {o.rank_max} is at or above the wire-time crossover rank ({crossover}), "
                    "as the release's calibration would make it.")
    lines += [
        "",
        "Means are over the steps after warm-up; training time covers all steps.",
        "",
        (f"Paper (measured, arXiv 2511.10333): communication latency down by up to "
         f"{PAPER_COMM_REDUCTION * 100:.2f}%, training time down by up to {PAPER_TIME_REDUCTION * 100:.2f}%."),
        "",
        "Assumptions that differ from, or are not given by, the paper's setup:",
        "",
        ("- network: the α–β numbers and link sharing come from the cluster file, not the paper; "
         "every hop of a DP ring crosses nodes and the node's GPUs all sync at once (the DAC stagger "
         "between stages on one node is ignored); the hook's concurrent uncompressed and P all-reduces "
         "are serialised; no congestion, no NVLink, no overlap of sync with backward (as in edgc's hook)."),
        ("- compute: one number per step (given, or 6·N·tokens at an assumed sustained FLOP/s); "
         f"t_mb = {c.backward_fraction:.2f} of one of the (micro-batches + pp − 1) 1F1B slots; "
         "pipeline activation traffic and the sum of the tied embedding's two copies between first and last "
         "stage are left out."),
        ("- layout: blocks split evenly over stages, Megatron column/row tensor-parallel splits, "
         + _TP_LAYOUT_NOTES[o.tp_layout]),
        ("- EDGC's rank follows a fixed schedule standing in for the entropy trajectory (no window "
         "rate limit, no error-check warm-up gate); the stage-0 rank is rounded to a multiple of "
         f"{o.rank_multiple}; DAC uses each stage's own α–β + compression-cost T(r)."),
        dac_note,
        _arithmetic_note(profile),
        ("- the compressed path's non-finite checks and the r_max calibration probes are not costed; "
         f"gradients travel as {c.grad_bytes}-byte values."),
    ]
    if isinstance(profile.source, RooflineModel):
        lines += _breakdown(proj, profile.source)
    return "\n".join(lines) + "\n"
