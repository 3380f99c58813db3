"""`edgc simulate`: an α–β projection of per-step DP sync and training time onto a cluster.

Nothing here talks to a network. A cluster is described by a `ClusterSpec` (TOML files in
`edgc/bench/clusters/`, two of them the paper's setups); the model's real parameter shapes
come from `build_model(preset, device="meta")`; the compression arithmetic is timed on this
machine (`CostProfile`); everything else is arithmetic:

1. Gradient shards. Each GPU all-reduces, over its DP group of N = dp replicas, the gradient
   of its own (pipeline stage, tensor-parallel rank) shard (`stage_gradients`).
2. Ring all-reduce of S bytes: T(S) = 2(N−1)·α + 2(N−1)/N · S/B (`ring_allreduce_time`),
   B the inter-node bandwidth one ring gets (`ClusterSpec.ring_bandwidth`).
3. One stage's sync (`stage_sync`), as edgc.comm's hook does it:
   - uncompressed: one all-reduce of the whole shard;
   - PowerSGD at rank r: an all-reduce of P (m·r per matrix), one of Q (n·r per matrix) and
     one of the uncompressed rest (1-D tensors and matrices that `compressible` rejects at
     r_max with the minimum rate), each with its own latency term, plus the measured
     arithmetic (project_p + orthogonalize_ + project_q + reconstruct);
   - EDGC adds the GDS entropy estimate (sample_gradient + estimate_entropy at β on the
     shard), amortised by α because it runs every 1/α steps, and its 32-byte control
     all-reduce on those steps.
4. A step (`StepProjection`): compute + the DP sync exposed after stage 0's last backward.
   In 1F1B stage p finishes its last backward about p·t_mb before stage 0, so the exposed
   sync is max_p(T_p − p·t_mb), with t_mb the backward time of one micro-batch.
5. Methods (`simulate`): none; static PowerSGD at r_max on every stage; EDGC with a stage-0
   rank schedule standing in for the entropy trajectory and DAC ranks on the other stages
   (`edgc.policy.dac.dac_ranks`), once with the spec's DAC rule and once with the rank
   capped at r_max. Means are taken over the steps after warm-up, totals over the run.

Simplifications are listed where they are made and printed by `run` under "Assumptions".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import platform
import re
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from edgc.bench.comm import ring_allreduce_seconds
from edgc.bench.netns import parse_rate
from edgc.compress import compressible, orthogonalize_, project_p, project_q, reconstruct
from edgc.config import EDGCConfig, reject_unknown_fields
from edgc.entropy import estimate_entropy, sample_gradient
from edgc.models.gpt2 import GPT, PRESETS, build_model
from edgc.policy.dac import dac_ranks, smallest_rank
from edgc.policy.window import limit_rank
from edgc.train.config import load_config_file

logger = logging.getLogger(__name__)

__all__ = [
    "ClusterSpec",
    "CostProfile",
    "MethodProjection",
    "Projection",
    "SimOptions",
    "StageGradients",
    "StageSync",
    "StepProjection",
    "add_parser",
    "bundled_clusters",
    "format_projection",
    "load_cluster",
    "parse_bandwidth",
    "parse_schedule",
    "profile_needs",
    "ring_allreduce_time",
    "run",
    "simulate",
    "stage_gradients",
    "stage_sync",
    "wire_crossover_rank",
]

# The paper's headline figures (arXiv 2511.10333; EDGC_SPEC.md, "Reported setup and results").
PAPER_COMM_REDUCTION = 0.4645
PAPER_TIME_REDUCTION = 0.1613

# Bytes of the hook's control vector (4 float64 values), all-reduced on entropy steps.
_CONTROL_BYTES = 32

_PROFILE_FORMAT = "edgc-cost-profile"
_PROFILE_VERSION = 1


# --------------------------------------------------------------------------------------
# Cluster description


def parse_bandwidth(value: str | float) -> float:
    """Return a bandwidth in bytes per second.

    A number is taken as bytes/s. A string uses tc's rate syntax, shared with
    `edgc bench comm --bandwidth` (`edgc.bench.netns.parse_rate`): "100gbit", "200mbit"
    and "25gbit" are bits per second; "25Gbps" is, as in tc, 25 giga*bytes* per second.
    Raises ValueError for anything else or a non-positive value.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"bandwidth {value!r} must be a positive number of bytes/s")
        return float(value)
    return parse_rate(str(value)) / 8.0


@dataclass(kw_only=True)
class ClusterSpec:
    """A training cluster and job, as far as the α–β model needs it."""

    name: str
    """A label for the output."""

    preset: str
    """Model preset (`edgc.models.gpt2.PRESETS`) whose parameter shapes are synchronised."""

    gpus: int
    """GPUs in the job; must equal tp * pp * dp."""

    tp: int
    """Tensor-parallel degree (Megatron column/row splits of each block's matrices)."""

    pp: int
    """Pipeline-parallel degree; the transformer blocks are split evenly over the stages."""

    dp: int
    """Data-parallel degree N: the ring size of every gradient all-reduce."""

    bandwidth: float
    """Inter-node bandwidth of one node, bytes/s (strings like "100gbit" are parsed)."""

    latency: float
    """α: seconds per ring step of an inter-node all-reduce."""

    gpus_per_node: int = 8
    """GPUs in one server."""

    link_sharing: int | None = None
    """GPUs of one node whose DP rings cross the node's inter-node link at the same time;
    each ring gets bandwidth / link_sharing. None: gpus_per_node (every GPU's DP peers are
    on other nodes, and all of them sync together)."""

    step_compute_s: float | None = None
    """Seconds of forward + backward compute per step (pipeline bubble included). None:
    derived from `achieved_flops`. Give one of the two."""

    achieved_flops: float | None = None
    """Sustained model FLOP/s per GPU over a whole step; the compute time is then
    6 · params · tokens / (gpus · achieved_flops), tokens = global_batch · seq_len."""

    micro_batch: int = 4
    """Sequences per micro-batch (paper: 4)."""

    global_batch: int
    """Sequences per optimiser step over all replicas (paper: 64 or 128)."""

    seq_len: int = 1024
    """Tokens per sequence (paper: 1024)."""

    grad_bytes: int = 2
    """Bytes per gradient element on the wire (2 for fp16/bf16)."""

    backward_fraction: float = 2.0 / 3.0
    """Share of a micro-batch's forward + backward time spent in backward (2/3: the
    backward pass does about twice the forward's FLOPs, without recomputation)."""

    steps: int = 10_000
    """Optimiser steps of the projected training run."""

    def __post_init__(self) -> None:
        self.bandwidth = parse_bandwidth(self.bandwidth)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field; the layout error shows the arithmetic."""
        if self.preset not in PRESETS:
            raise ValueError(f"ClusterSpec.preset={self.preset!r}: known presets are {', '.join(PRESETS)}")
        for name in ("gpus", "tp", "pp", "dp", "gpus_per_node", "micro_batch", "global_batch", "seq_len",
                     "grad_bytes", "steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ClusterSpec.{name}={value!r}: must be a positive integer")
        if self.tp * self.pp * self.dp != self.gpus:
            raise ValueError(
                f"ClusterSpec {self.name!r}: parallel layout does not match the GPU count: "
                f"tp({self.tp}) * pp({self.pp}) * dp({self.dp}) != gpus({self.gpus}) "
                f"(the product is {self.tp * self.pp * self.dp})"
            )
        per_step = self.micro_batch * self.dp
        if self.global_batch % per_step != 0:
            raise ValueError(
                f"ClusterSpec {self.name!r}: global_batch({self.global_batch}) is not a multiple of "
                f"micro_batch({self.micro_batch}) * dp({self.dp}) = {per_step}"
            )
        if self.link_sharing is not None and (not isinstance(self.link_sharing, int) or self.link_sharing < 1):
            raise ValueError(f"ClusterSpec.link_sharing={self.link_sharing!r}: must be a positive integer or None")
        if not (isinstance(self.latency, (int, float)) and math.isfinite(self.latency) and self.latency >= 0):
            raise ValueError(f"ClusterSpec.latency={self.latency!r}: must be seconds >= 0")
        if (self.step_compute_s is None) == (self.achieved_flops is None):
            raise ValueError(f"ClusterSpec {self.name!r}: give exactly one of step_compute_s and achieved_flops")
        for name in ("step_compute_s", "achieved_flops"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"ClusterSpec.{name}={value!r}: must be positive")
        if not 0.0 < self.backward_fraction <= 1.0:
            raise ValueError(f"ClusterSpec.backward_fraction={self.backward_fraction!r}: must be in (0, 1]")

    @property
    def micro_batches(self) -> int:
        """Micro-batches each pipeline runs per step: global_batch / (micro_batch · dp)."""
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def ring_bandwidth(self) -> float:
        """Bytes/s one DP ring gets: the node's inter-node bandwidth over the rings sharing it."""
        sharing = self.link_sharing if self.link_sharing is not None else self.gpus_per_node
        return self.bandwidth / sharing

    def compute_seconds(self, n_params: int) -> float:
        """Return the step's compute time: `step_compute_s`, or 6·params·tokens / (gpus·achieved_flops)."""
        if self.step_compute_s is not None:
            return float(self.step_compute_s)
        tokens = self.global_batch * self.seq_len
        return 6.0 * n_params * tokens / (self.gpus * self.achieved_flops)

    def backward_per_micro_batch(self, compute_s: float) -> float:
        """Return t_mb: backward_fraction · compute / (micro_batches + pp − 1).

        A 1F1B step takes about (micro_batches + pp − 1) forward + backward slots on each
        stage (the pipeline bubble included), so one slot is compute / (m + pp − 1).
        """
        return self.backward_fraction * compute_s / (self.micro_batches + self.pp - 1)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ClusterSpec:
        """Build from a mapping (e.g. a parsed TOML file); an unknown key raises ValueError naming it."""
        reject_unknown_fields(cls, values, "ClusterSpec has no field(s)")
        missing = sorted(f.name for f in dataclasses.fields(cls) if f.name not in values
                         and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        if missing:
            raise ValueError(f"ClusterSpec needs field(s) {missing}")
        return cls(**values)


def bundled_clusters() -> list[str]:
    """Return the names of the cluster files shipped in edgc/bench/clusters/."""
    folder = resources.files("edgc.bench").joinpath("clusters")
    return sorted(p.name[: -len(".toml")] for p in folder.iterdir() if p.name.endswith(".toml"))


def load_cluster(name_or_path: str) -> ClusterSpec:
    """Return the ClusterSpec of a bundled cluster name ("paper-2.5b") or a TOML/JSON file.

    Raises ValueError for an unknown name or an invalid file, FileNotFoundError for a
    missing path.
    """
    path = Path(name_or_path)
    if not path.is_file() and path.suffix not in (".toml", ".json") and os.sep not in name_or_path:
        names = bundled_clusters()
        if name_or_path not in names:
            raise ValueError(f"unknown cluster {name_or_path!r}; bundled: {', '.join(names)}, or give a TOML file")
        with resources.as_file(resources.files("edgc.bench").joinpath("clusters", f"{name_or_path}.toml")) as p:
            values = load_config_file(p)
    else:
        values = load_config_file(path)
    values.setdefault("name", path.stem)
    return ClusterSpec.from_dict(values)


# --------------------------------------------------------------------------------------
# Gradient shards


@dataclass(frozen=True)
class StageGradients:
    """The gradient one GPU of pipeline stage `stage` all-reduces over its DP group."""

    stage: int
    shapes: tuple[tuple[int, ...], ...]
    """Shapes of the tensors of this GPU's (stage, tensor-parallel rank) shard."""

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


# Megatron's split dimension of each block parameter, by name suffix, for nn.Linear's
# (out_features, in_features) weights: column-parallel layers (qkv, fc) split the output
# dimension and their bias with it; row-parallel layers (attn proj, mlp proj) split the
# input dimension and keep their bias whole. LayerNorms are replicated.
_TP_SPLIT = {
    "attn.c_attn.weight": 0,
    "attn.c_attn.bias": 0,
    "mlp.c_fc.weight": 0,
    "mlp.c_fc.bias": 0,
    "attn.c_proj.weight": 1,
    "mlp.c_proj.weight": 1,
}
_REPLICATED = ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "attn.c_proj.bias", "mlp.c_proj.bias")


def _shard(shape: torch.Size, dim: int | None, tp: int) -> tuple[int, ...]:
    """`shape` with dimension `dim` divided by tp (rounded up); unchanged when dim is None."""
    out = [int(d) for d in shape]
    if dim is not None:
        out[dim] = -(-out[dim] // tp)
    return tuple(out)


def stage_gradients(model: GPT, tp: int, pp: int) -> list[StageGradients]:
    """Return, per pipeline stage, the gradient shapes one GPU of that stage synchronises.

    A simplified Megatron layout of the model's real parameters (`model` may live on the
    meta device):

    - blocks are split evenly over the pp stages (the first n_layer % pp stages get one
      more); stage 0 also holds wte and wpe, the last stage ln_f;
    - the head is tied to wte and counted once, on stage 0 (Megatron keeps a copy on the
      last stage and all-reduces the two copies' gradients; that extra sync is left out);
    - wte is split over tp along the vocabulary (rounded up; Megatron pads the vocabulary
      to a multiple of 128·tp instead); wpe and LayerNorms are replicated;
    - qkv and fc are column-parallel (output dimension and bias split), attn proj and mlp
      proj row-parallel (input dimension split, bias replicated).

    Raises ValueError if pp exceeds the number of blocks or a parameter has no known place.
    Changes nothing.
    """
    n_layer = model.config.n_layer
    if pp > n_layer:
        raise ValueError(f"pp({pp}) exceeds the model's {n_layer} blocks")
    per_stage = [n_layer // pp + (1 if s < n_layer % pp else 0) for s in range(pp)]
    first_block = [sum(per_stage[:s]) for s in range(pp)]
    stage_of_block = {b: s for s in range(pp) for b in range(first_block[s], first_block[s] + per_stage[s])}
    shapes: list[list[tuple[int, ...]]] = [[] for _ in range(pp)]
    for name, p in model.named_parameters():  # a tied parameter is yielded once (as wte.weight)
        if name == "wte.weight":
            shapes[0].append(_shard(p.shape, 0, tp))  # (V/tp, C)
        elif name == "wpe.weight":
            shapes[0].append(_shard(p.shape, None, tp))  # (block_size, C)
        elif name.startswith("ln_f."):
            shapes[pp - 1].append(_shard(p.shape, None, tp))
        elif name.startswith("h."):
            _, index, rest = name.split(".", 2)
            if rest in _TP_SPLIT:
                dim = _TP_SPLIT[rest]
            elif rest in _REPLICATED:
                dim = None
            else:
                raise ValueError(f"parameter {name!r} has no tensor-parallel layout in stage_gradients")
            shapes[stage_of_block[int(index)]].append(_shard(p.shape, dim, tp))
        else:
            raise ValueError(f"parameter {name!r} has no pipeline stage in stage_gradients")
    return [StageGradients(s, tuple(sh)) for s, sh in enumerate(shapes)]


# --------------------------------------------------------------------------------------
# Compression cost, measured


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class CostProfile:
    """Measured seconds of EDGC's local arithmetic on one device, cached and saved as JSON.

    - low-rank round: seconds per matrix of project_p + orthogonalize_ + project_q +
      reconstruct at (m, n, r), timed on a batch of min(count, `max_batch`) same-shape
      matrices (the hook's batched bmm) and divided by the batch; between measured ranks
      the time is interpolated linearly in r, outside them scaled in proportion to r;
    - entropy: seconds per gradient element of sample_gradient + estimate_entropy at β,
      timed once on `entropy_elements` elements and scaled linearly to a stage's size.

    `compute_scale` multiplies every time it returns (e.g. to project CPU times onto a
    GPU); the stored measurements stay as measured.
    """

    def __init__(
        self,
        device: str | torch.device = "cpu",
        *,
        dtype: torch.dtype = torch.float32,
        repeats: int = 3,
        max_batch: int = 2,
        entropy_elements: int = 1 << 24,
        compute_scale: float = 1.0,
    ) -> None:
        # hyperparameters
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: CUDA is not available on this machine")
        self.dtype = dtype
        self.repeats = repeats
        self.max_batch = max_batch
        self.entropy_elements = entropy_elements
        if not (math.isfinite(compute_scale) and compute_scale > 0):
            raise ValueError(f"compute_scale must be positive, got {compute_scale}")
        self.compute_scale = compute_scale
        # internal state: measurements
        self.lowrank: dict[tuple[int, int, int], float] = {}  # (m, n, r) -> seconds per matrix
        self.entropy: dict[tuple[float, str, int], float] = {}  # (β, estimator, bins) -> s/element
        self.sources: set[str] = set()  # "device name (torch x)" of every measurement
        # stats
        self.measured = 0  # entries measured by this object (not loaded)
        self.measure_seconds = 0.0

    # --- measuring

    def _source(self) -> str:
        return f"{self.device.type}: {_device_name(self.device)}, torch {torch.__version__}, {self.dtype}"

    def _time(self, fn: Callable[[], Any]) -> float:
        """Median seconds of fn() over `repeats` runs after one untimed warm-up run."""
        fn()
        times = []
        for _ in range(self.repeats):
            _synchronize(self.device)
            t0 = time.perf_counter()
            fn()
            _synchronize(self.device)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def _time_round(self, mat: torch.Tensor, r: int, gen: torch.Generator) -> float:
        """Seconds of one low-rank round on the batch `mat` (B, m, n) at rank r."""
        b, m, n = mat.shape
        q0 = torch.randn((b, n, r), generator=gen).to(self.device, self.dtype)  # (B, n, r)
        p = torch.empty((b, m, r), device=self.device, dtype=self.dtype)
        q = torch.empty((b, n, r), device=self.device, dtype=self.dtype)

        def one_round() -> None:
            project_p(mat, q0, out=p)  # (B, m, r)
            orthogonalize_(p)
            project_q(mat, p, out=q)  # (B, n, r)
            reconstruct(p, q)  # (B, m, n)

        return self._time(one_round)

    def ensure_lowrank(self, shapes: dict[tuple[int, int], int], ranks: Sequence[int]) -> None:
        """Measure every missing (m, n, min(r, m, n)) for `shapes` {(m, n): count} and `ranks`."""
        gen = torch.Generator().manual_seed(0)
        for (m, n), count in sorted(shapes.items()):
            todo = sorted({min(r, m, n) for r in ranks} - {r for (mm, nn, r) in self.lowrank if (mm, nn) == (m, n)})
            if not todo:
                continue
            t_start = time.perf_counter()
            b = max(1, min(count, self.max_batch))
            mat = torch.randn((b, m, n), generator=gen).to(self.device, self.dtype)  # (B, m, n)
            for r in todo:
                self.lowrank[(m, n, r)] = self._time_round(mat, r, gen) / b
                self.measured += 1
            self.sources.add(self._source())
            self.measure_seconds += time.perf_counter() - t_start
            logger.info("profiled (%s, %s) x%s at ranks %s in %.2fs", m, n, b, todo, time.perf_counter() - t_start)

    def ensure_entropy(self, rate: float, estimator: str, bins: int) -> None:
        """Measure the GDS cost per element at β = `rate` unless already known."""
        key = (float(rate), estimator, int(bins))
        if key in self.entropy:
            return
        t_start = time.perf_counter()
        gen = torch.Generator().manual_seed(1)
        grad = (torch.randn(self.entropy_elements, generator=gen) * 1e-3).to(self.device, self.dtype)
        seconds = self._time(lambda: estimate_entropy(sample_gradient([grad], rate), estimator, bins))
        self.entropy[key] = seconds / self.entropy_elements
        self.measured += 1
        self.sources.add(self._source())
        self.measure_seconds += time.perf_counter() - t_start

    # --- looking up

    def lowrank_seconds(self, m: int, n: int, rank: int) -> float:
        """Return the scaled seconds of one low-rank round on one (m, n) matrix at `rank`.

        Raises KeyError if (m, n) was never measured.
        """
        r = min(rank, m, n)
        points = sorted((rr, t) for (mm, nn, rr), t in self.lowrank.items() if (mm, nn) == (m, n))
        if not points:
            raise KeyError(f"no cost measured for a ({m}, {n}) matrix")
        exact = dict(points)
        if r in exact:
            t = exact[r]
        elif r < points[0][0]:
            t = points[0][1] * r / points[0][0]
        elif r > points[-1][0]:
            t = points[-1][1] * r / points[-1][0]
        else:
            (r0, t0), (r1, t1) = next((a, b) for a, b in pairwise(points) if a[0] < r < b[0])
            t = t0 + (t1 - t0) * (r - r0) / (r1 - r0)
        return t * self.compute_scale

    def entropy_seconds(self, numel: int, rate: float, estimator: str, bins: int) -> float:
        """Return the scaled seconds of one GDS estimate over `numel` gradient elements."""
        return self.entropy[(float(rate), estimator, int(bins))] * numel * self.compute_scale

    # --- persistence

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": _PROFILE_FORMAT,
            "version": _PROFILE_VERSION,
            "sources": sorted(self.sources),
            "lowrank": [{"m": m, "n": n, "rank": r, "seconds_per_matrix": t}
                        for (m, n, r), t in sorted(self.lowrank.items())],
            "entropy": [{"gradient_sample_rate": rate, "estimator": est, "bins": bins, "seconds_per_element": t}
                        for (rate, est, bins), t in sorted(self.entropy.items())],
        }

    def save(self, path: str | Path) -> None:
        """Write the measurements (unscaled) as JSON to `path`."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    def load(self, path: str | Path) -> None:
        """Add the measurements of a JSON file written by `save`; raises ValueError if it is not one."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"profile {str(path)!r} does not exist")
        try:
            d = json.loads(path.read_text())
            if d.get("format") != _PROFILE_FORMAT:
                raise ValueError(f"not an {_PROFILE_FORMAT} file")
            for e in d["lowrank"]:
                self.lowrank[(int(e["m"]), int(e["n"]), int(e["rank"]))] = float(e["seconds_per_matrix"])
            for e in d["entropy"]:
                key = (float(e["gradient_sample_rate"]), str(e["estimator"]), int(e["bins"]))
                self.entropy[key] = float(e["seconds_per_element"])
            self.sources.update(d.get("sources", []))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"profile {str(path)!r} is not a valid cost profile: {exc}") from None


# --------------------------------------------------------------------------------------
# The α–β model


def ring_allreduce_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Return T(S) = 2(N−1)·α + 2(N−1)/N · S/B for a ring all-reduce of S = `nbytes` bytes.

    `bandwidth` is B in bytes/s, `latency` α in seconds; 0 for N = 1.
    """
    return ring_allreduce_seconds(nbytes, n, 8.0 * bandwidth, latency)


@dataclass(kw_only=True)
class SimOptions:
    """What is projected, besides the cluster."""

    rank_max: int = 32
    """r_max: the static PowerSGD rank and EDGC's upper bound (release fixed-rank default 32)."""

    rank_min: int | None = None
    """r_min; None: rank_max // 4 (the paper recommends r_max/4 to r_max/6)."""

    warmup_fraction: float = 0.1
    """Share of the steps trained uncompressed before compression starts (release: 10%)."""

    edgc_schedule: tuple[tuple[float, float], ...] | None = None
    """EDGC's stage-0 rank as (fraction of training, rank) knots, linear in between and
    uncompressed before the first knot. None: (warmup_fraction, r_max) to (1.0, r_min)."""

    min_compression_rate: float = EDGCConfig.min_compression_rate
    """A matrix is compressed only if m·n / ((m+n)·r_max) reaches this (as in the hook)."""

    iteration_sample_rate: float = EDGCConfig.iteration_sample_rate
    """α of the GDS: entropy is estimated every 1/α steps."""

    gradient_sample_rate: float = EDGCConfig.gradient_sample_rate
    """β of the GDS: the share of gradient elements the estimate reads."""

    entropy_estimator: str = EDGCConfig.entropy_estimator
    bins: int = EDGCConfig.bins
    rank_multiple: int = EDGCConfig.rank_multiple
    """The stage-0 rank is rounded to a multiple of this (release: even)."""

    def __post_init__(self) -> None:
        if self.rank_max < 1:
            raise ValueError(f"rank_max must be >= 1, got {self.rank_max}")
        if not 1 <= self.resolved_rank_min <= self.rank_max:
            raise ValueError(f"rank_min must be in [1, rank_max={self.rank_max}], got {self.rank_min}")
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction}")
        _check_schedule(self.schedule, self.rank_max)

    @property
    def resolved_rank_min(self) -> int:
        return self.rank_min if self.rank_min is not None else max(1, self.rank_max // 4)

    @property
    def schedule(self) -> tuple[tuple[float, float], ...]:
        """The EDGC stage-0 schedule, the default filled in."""
        if self.edgc_schedule is not None:
            return tuple(self.edgc_schedule)
        return ((self.warmup_fraction, float(self.rank_max)), (1.0, float(self.resolved_rank_min)))


def _check_schedule(schedule: Sequence[tuple[float, float]], rank_max: int) -> None:
    if not schedule:
        raise ValueError("the EDGC schedule needs at least one (fraction, rank) knot")
    fractions = [f for f, _ in schedule]
    if any(not 0.0 <= f <= 1.0 for f in fractions) or fractions != sorted(fractions):
        raise ValueError(f"EDGC schedule fractions must rise within [0, 1], got {fractions}")
    if any(not 1 <= r <= rank_max for _, r in schedule):
        raise ValueError(f"EDGC schedule ranks must lie in [1, rank_max={rank_max}], got {[r for _, r in schedule]}")


def parse_schedule(text: str) -> tuple[tuple[float, float], ...]:
    """Parse "FRACTION:RANK,..." (e.g. "0.1:32,1.0:8") into (fraction, rank) knots."""
    knots = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*([0-9.]+)\s*:\s*([0-9.]+)\s*", part)
        if not m:
            raise ValueError(f"--edgc-schedule {text!r}: expected FRACTION:RANK pairs like 0.1:32,1.0:8")
        knots.append((float(m.group(1)), float(m.group(2))))
    return tuple(knots)


def _schedule_rank(schedule: Sequence[tuple[float, float]], fraction: float, rank_max: int, multiple: int) -> int | None:
    """Stage-0 rank at `fraction` of training; None before the first knot (warm-up)."""
    if fraction < schedule[0][0]:
        return None
    value = schedule[-1][1]
    for (f0, r0), (f1, r1) in pairwise(schedule):
        if f0 <= fraction < f1:
            value = r0 + (r1 - r0) * (fraction - f0) / (f1 - f0)
            break
    low = int(min(r for _, r in schedule))
    return limit_rank(value, round(value), r_min=max(1, low), r_max=rank_max, step=None, multiple=multiple)


@dataclass(frozen=True)
class StageSync:
    """One stage's DP gradient sync for one step, per replica."""

    rank: int | None
    """PowerSGD rank, or None for an uncompressed all-reduce."""
    bytes: float
    """Bytes handed to all-reduces (control vector excluded)."""
    wire_s: float
    """α–β time of the all-reduces."""
    compress_s: float
    """Low-rank arithmetic (scaled profile)."""
    entropy_s: float
    """GDS entropy estimate amortised over 1/α steps (EDGC only)."""

    @property
    def total_s(self) -> float:
        return self.wire_s + self.compress_s + self.entropy_s


def _matrix(shape: tuple[int, ...]) -> tuple[int, int]:
    return shape[0], math.prod(shape[1:])


def _split(stage: StageGradients, opts: SimOptions) -> tuple[Counter, int]:
    """({(m, n): count} of the matrices the hook compresses, numel of the rest)."""
    mats: Counter = Counter()
    rest = 0
    for shape in stage.shapes:
        if compressible(shape, opts.rank_max, opts.min_compression_rate):
            mats[_matrix(shape)] += 1
        else:
            rest += math.prod(shape)
    return mats, rest


def stage_sync(
    stage: StageGradients,
    rank: int | None,
    cluster: ClusterSpec,
    profile: CostProfile,
    opts: SimOptions,
    *,
    entropy: bool,
) -> StageSync:
    """Return the sync of `stage`'s shard at `rank` (None: uncompressed) for one step.

    Compressed: all-reduces of P (Σ m·r elements), Q (Σ n·r) and the uncompressed rest, r
    clipped to min(r, m, n) per matrix as the hook does. `entropy` adds the GDS cost and
    the control all-reduce, both times α. The profile must hold the stage's shapes.
    """
    n, bw, lat, eb = cluster.dp, cluster.ring_bandwidth, cluster.latency, cluster.grad_bytes
    ent = 0.0
    wire = 0.0
    if entropy:
        isr = opts.iteration_sample_rate
        ent = isr * profile.entropy_seconds(stage.numel, opts.gradient_sample_rate, opts.entropy_estimator, opts.bins)
        wire += isr * ring_allreduce_time(_CONTROL_BYTES, n, bw, lat)
    if rank is None:
        nbytes = stage.numel * eb
        return StageSync(None, nbytes, wire + ring_allreduce_time(nbytes, n, bw, lat), 0.0, ent)
    mats, rest = _split(stage, opts)
    p_elems = sum(c * m * min(rank, m, k) for (m, k), c in mats.items())  # P: (m, r) per matrix
    q_elems = sum(c * k * min(rank, m, k) for (m, k), c in mats.items())  # Q: (n, r) per matrix
    for elems in (rest, p_elems, q_elems):
        if elems:
            wire += ring_allreduce_time(elems * eb, n, bw, lat)
    compress = sum(c * profile.lowrank_seconds(m, k, rank) for (m, k), c in mats.items())
    return StageSync(rank, (rest + p_elems + q_elems) * eb, wire, compress, ent)


@dataclass(frozen=True)
class StepProjection:
    """One step under one assignment of ranks to pipeline stages."""

    ranks: tuple[int | None, ...]
    stages: tuple[StageSync, ...]
    compute_s: float
    t_mb: float

    @property
    def critical_stage(self) -> int:
        """The stage whose sync ends last after stage 0's last backward."""
        return max(range(len(self.stages)), key=lambda p: self.stages[p].total_s - p * self.t_mb)

    @property
    def exposed_s(self) -> float:
        """DP sync exposed after stage 0's last backward: max_p(T_p − p·t_mb)."""
        p = self.critical_stage
        return self.stages[p].total_s - p * self.t_mb

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_s


@dataclass(frozen=True)
class MethodProjection:
    """A method over the whole projected run."""

    method: str
    label: str
    warmup_steps: int
    first: StepProjection
    """The first step after warm-up (the only kind of step for "none")."""
    last: StepProjection
    """The last step."""
    sync_s: float
    """Mean exposed DP sync per step after warm-up."""
    wire_s: float
    """Mean α–β time of the critical stage after warm-up."""
    overhead_s: float
    """Mean compression + entropy time of the critical stage after warm-up."""
    step_s: float
    """Mean step time after warm-up."""
    total_s: float
    """Training time of all steps, warm-up included."""


@dataclass(frozen=True)
class Projection:
    """Everything `simulate` computed, for printing or tests."""

    cluster: ClusterSpec
    options: SimOptions
    n_params: int
    stages: tuple[StageGradients, ...]
    compute_s: float
    t_mb: float
    methods: tuple[MethodProjection, ...]

    def method(self, name: str) -> MethodProjection:
        return next(m for m in self.methods if m.method == name)


def _project_method(
    method: str, label: str, steps: int, step_at: Callable[[int], StepProjection], warmup_steps: int
) -> MethodProjection:
    """Accumulate `step_at(step)` over the run; means over steps >= warmup_steps."""
    total = sync = wire = overhead = step_sum = 0.0
    counted = 0
    first = last = None
    for step in range(steps):
        sp = step_at(step)
        total += sp.step_s
        if step >= warmup_steps:
            first = first or sp
            crit = sp.stages[sp.critical_stage]
            sync += sp.exposed_s
            wire += crit.wire_s
            overhead += crit.compress_s + crit.entropy_s
            step_sum += sp.step_s
            counted += 1
        last = sp
    k = max(1, counted)
    return MethodProjection(method, label, warmup_steps, first or last, last, sync / k, wire / k, overhead / k,
                            step_sum / k, total)


def profile_needs(stages: Sequence[StageGradients], opts: SimOptions) -> tuple[dict[tuple[int, int], int], list[int]]:
    """Return ({(m, n): largest count on one stage}, ranks to measure) for `simulate`.

    Ranks: r_min, r_max, the schedule's knots and every multiple of 8 between; others are
    interpolated by `CostProfile.lowrank_seconds`.
    """
    shapes: dict[tuple[int, int], int] = {}
    for stage in stages:
        for mn, c in _split(stage, opts)[0].items():
            shapes[mn] = max(shapes.get(mn, 0), c)
    lo = opts.resolved_rank_min
    ranks = {lo, opts.rank_max, *(int(r) for _, r in opts.schedule)}
    ranks |= set(range(8 * math.ceil(lo / 8), opts.rank_max, 8))
    return shapes, sorted(r for r in ranks if r >= 1)


def simulate(cluster: ClusterSpec, profile: CostProfile, opts: SimOptions) -> Projection:
    """Project none, static PowerSGD and EDGC (two DAC variants) onto `cluster`.

    The model is the cluster's preset with its position embedding sized to `seq_len`.
    Measures into `profile` whatever it lacks (see `profile_needs`); returns the Projection.
    """
    model = build_model(cluster.preset, block_size=cluster.seq_len, device="meta")
    n_params = model.num_parameters()
    stages = stage_gradients(model, cluster.tp, cluster.pp)
    shapes, ranks = profile_needs(stages, opts)
    profile.ensure_lowrank(shapes, ranks)
    profile.ensure_entropy(opts.gradient_sample_rate, opts.entropy_estimator, opts.bins)

    compute = cluster.compute_seconds(n_params)
    t_mb = cluster.backward_per_micro_batch(compute)
    steps = cluster.steps
    cache: dict[tuple, StepProjection] = {}

    def project(ranks_: Sequence[int | None], entropy: bool) -> StepProjection:
        key = (tuple(ranks_), entropy)
        if key not in cache:
            syncs = tuple(stage_sync(s, r, cluster, profile, opts, entropy=entropy) for s, r in zip(stages, ranks_))
            cache[key] = StepProjection(tuple(ranks_), syncs, compute, t_mb)
        return cache[key]

    pp = cluster.pp
    plain = [None] * pp
    static_warmup = round(opts.warmup_fraction * steps)
    r_max = opts.rank_max

    def time_of_rank(stage: StageGradients) -> Callable[[int], float]:
        """T(r) made non-decreasing for dac_ranks' bisection: max of T(r') over r' <= r.

        Measured arithmetic need not be monotone in r (on this project's CPU a narrow
        r = 8 bmm ran slower than r = 16); the envelope only matters where it is not.
        """
        envelope: list[float] = [0.0]  # envelope[r] for r = 0, 1, ...

        def t(r: int) -> float:
            while len(envelope) <= r:
                k = len(envelope)
                envelope.append(max(envelope[-1], stage_sync(stage, k, cluster, profile, opts, entropy=True).total_s))
            return envelope[r]
        return t

    t_of_rank = [time_of_rank(s) for s in stages]
    t_unc = [stage_sync(s, None, cluster, profile, opts, entropy=True).total_s for s in stages]

    dac: dict[tuple[int, bool], list[int | None]] = {}

    def edgc_step(cap: bool) -> Callable[[int], StepProjection]:
        def step_at(step: int) -> StepProjection:
            r0 = _schedule_rank(opts.schedule, step / steps, r_max, opts.rank_multiple)
            if r0 is None:
                return project(plain, True)
            if (r0, cap) not in dac:
                dac[(r0, cap)] = dac_ranks(t_of_rank, r0, t_mb, pp, r_max, t_unc, cap_at_r_max=cap)
            return project(dac[(r0, cap)], True)
        return step_at

    edgc_warmup = next((s for s in range(steps) if s / steps >= opts.schedule[0][0]), steps)
    methods = (
        _project_method("none", "none", steps, lambda s: project(plain, False), 0),
        _project_method("powersgd", f"PowerSGD r={r_max}", steps,
                        lambda s: project(plain if s < static_warmup else [r_max] * pp, False), static_warmup),
        _project_method("edgc", "EDGC (DAC as specified)", steps, edgc_step(False), edgc_warmup),
        _project_method("edgc-cap", "EDGC (DAC capped at r_max)", steps, edgc_step(True), edgc_warmup),
    )
    return Projection(cluster, opts, n_params, tuple(stages), compute, t_mb, methods)


def wire_crossover_rank(stage: StageGradients, cluster: ClusterSpec, opts: SimOptions) -> int:
    """Return the smallest rank whose α–β wire time reaches the uncompressed one (no compute).

    This is where the release's r_max calibration would land on an ideal network with free
    arithmetic; the compressible set is held at the one chosen for `opts.rank_max`.
    """
    mats, rest = _split(stage, opts)
    if not mats:
        return 0
    n, bw, lat, eb = cluster.dp, cluster.ring_bandwidth, cluster.latency, cluster.grad_bytes
    plain = ring_allreduce_time(stage.numel * eb, n, bw, lat)

    def wire(r: int) -> float:
        p = sum(c * m * min(r, m, k) for (m, k), c in mats.items())
        q = sum(c * k * min(r, m, k) for (m, k), c in mats.items())
        return sum(ring_allreduce_time(e * eb, n, bw, lat) for e in (rest, p, q) if e)

    hi = max(min(m, k) for m, k in mats)
    if wire(hi) < plain:
        return hi
    return smallest_rank(lambda r: wire(r) >= plain, 1, hi)


# --------------------------------------------------------------------------------------
# Output


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


def format_projection(proj: Projection, profile: CostProfile) -> str:
    """Return the markdown report: setup, table, paper figures, assumptions."""
    c, o = proj.cluster, proj.options
    base = proj.method("none")
    gbit = 8e-9
    flops = f" (6 x params x tokens / ({c.gpus} x {c.achieved_flops / 1e12:g} TFLOP/s))" if c.achieved_flops else ""
    sources = "; ".join(sorted(profile.sources)) or "none"
    on_cpu = any(s.startswith("cpu") for s in profile.sources)
    warning = " -- CPU times, NOT a GPU's" if on_cpu and profile.compute_scale == 1 else ""
    lines = [
        f"## edgc simulate: {c.preset} ({proj.n_params / 1e9:.2f}B parameters) on {c.name}",
        "",
        (f"- layout: {c.gpus} GPUs = TP{c.tp} x PP{c.pp} x DP{c.dp}, {c.gpus_per_node} GPUs/node; "
         f"{c.micro_batches} micro-batches of {c.micro_batch} x {c.seq_len} tokens per pipeline "
         f"(global batch {c.global_batch}), {c.steps:,} steps"),
        (f"- network (α–β): {c.bandwidth * gbit:g} Gbit/s per node shared by "
         f"{c.link_sharing or c.gpus_per_node} rings -> {c.ring_bandwidth * gbit:g} Gbit/s "
         f"({c.ring_bandwidth / 1e9:.3g} GB/s) per DP ring of N={c.dp}, α = {c.latency * 1e6:g} µs"),
        f"- compute: {proj.compute_s:.3f} s/step{flops}; t_mb (backward per micro-batch) = {_ms(proj.t_mb)}",
        (f"- gradient per GPU by stage: {', '.join(f'{s.numel / 1e6:.1f}M' for s in proj.stages)} elements "
         f"x {c.grad_bytes} bytes"),
        (f"- ranks: r_max {o.rank_max}, r_min {o.resolved_rank_min}; EDGC stage-0 schedule "
         f"{', '.join(f'{f:g}:{r:g}' for f, r in o.schedule)} (fraction:rank, uncompressed before the first)"),
        f"- compression/entropy compute: measured on {sources}; scaled x{profile.compute_scale:g}{warning}",
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
    scale_note = ("as measured" if profile.compute_scale == 1
                  else f"multiplied by --compute-scale {profile.compute_scale:g} (an assumption about the target GPU)")
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
         "pipeline activation traffic and the embedding-copy sync between first and last stage are left out."),
        ("- layout: blocks split evenly over stages, Megatron column/row tensor-parallel splits, "
         "vocabulary split by ceil(V/tp) without Megatron's padding; tied head counted once on stage 0."),
        ("- EDGC's rank follows a fixed schedule standing in for the entropy trajectory (no window "
         "rate limit, no error-check warm-up gate); the stage-0 rank is rounded to a multiple of "
         f"{o.rank_multiple}; DAC uses each stage's own α–β + measured-compute T(r)."),
        dac_note,
        ("- compression arithmetic: float32, timed per (m, n, r) on batches of up to "
         f"{profile.max_batch} same-shape matrices and scaled by count, interpolated linearly between the "
         "measured ranks; the GDS cost was timed once and scaled linearly with the gradient size; "
         f"both {scale_note}."),
        ("- error feedback, the non-finite checks and the r_max calibration probes are not costed; "
         f"gradients travel as {c.grad_bytes}-byte values."),
    ]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------
# CLI


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the `simulate` subcommand to `sub` (run it with `run`)."""
    p = sub.add_parser(
        "simulate", help="project per-step DP sync and training time onto a cluster (α–β model)",
        description="Project none, static PowerSGD and EDGC onto a cluster with an α–β network model, "
                    "the model's real gradient shapes and compression costs measured on this machine.")
    p.add_argument("--cluster", default="paper-2.5b",
                   help="a bundled cluster (paper-2.5b, paper-12.1b) or a TOML file of ClusterSpec fields")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="model preset (default: the cluster's)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the cluster's)")
    p.add_argument("--rank-max", type=int, default=32, help="r_max: static PowerSGD rank and EDGC's upper bound")
    p.add_argument("--rank-min", type=int, default=None, help="r_min (default: rank-max // 4)")
    p.add_argument("--warmup-fraction", type=float, default=0.1, help="share of steps trained uncompressed")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--edgc-mean-rank", type=float, default=None,
                       help="EDGC stage-0 rank held constant after warm-up")
    group.add_argument("--edgc-schedule", default=None,
                       help='EDGC stage-0 rank as "FRACTION:RANK,..." knots, e.g. "0.1:32,1.0:8" '
                            "(default: warm-up, then r_max falling linearly to r_min)")
    p.add_argument("--profile", metavar="FILE", help="load measured compression costs (JSON) first")
    p.add_argument("--save-profile", metavar="FILE", help="write the (unscaled) cost profile as JSON")
    p.add_argument("--device", default="cpu", help='where missing costs are measured: "cpu" or "cuda"')
    p.add_argument("--compute-scale", type=float, default=1.0,
                   help="multiply measured compression/entropy times (e.g. CPU -> GPU); default: as measured")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per measured shape and rank")


def run(args: argparse.Namespace) -> int:
    """Run `edgc simulate` from parsed arguments: print the markdown report; returns 0."""
    cluster = load_cluster(args.cluster)
    overrides = {k: v for k, v in (("preset", args.preset), ("steps", args.steps)) if v is not None}
    if overrides:
        cluster = ClusterSpec.from_dict({**cluster.__dict__, **overrides})
    schedule = None
    if args.edgc_mean_rank is not None:
        schedule = ((args.warmup_fraction, args.edgc_mean_rank), (1.0, args.edgc_mean_rank))
    elif args.edgc_schedule:
        schedule = parse_schedule(args.edgc_schedule)
    opts = SimOptions(rank_max=args.rank_max, rank_min=args.rank_min, warmup_fraction=args.warmup_fraction,
                      edgc_schedule=schedule)
    profile = CostProfile(args.device, repeats=args.repeats, compute_scale=args.compute_scale)
    if args.profile:
        profile.load(args.profile)
    proj = simulate(cluster, profile, opts)
    if profile.measured:
        print(f"(measured {profile.measured} cost entries on {args.device} in {profile.measure_seconds:.1f}s)")
    if args.save_profile:
        profile.save(args.save_profile)
        print(f"cost profile: {args.save_profile}")
    print(format_projection(proj, profile), end="")
    return 0
