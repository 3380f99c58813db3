"""The cluster and job `edgc simulate` projects onto: `ClusterSpec`, and the bundled TOML files.

The bundled files live in `edgc/bench/clusters/` (package data of `edgc.bench`); two of
them describe the EDGC paper's setups. A file names its GPU (`gpu = "V100"`), which picks
the roofline model of `edgc.bench.simulate.gpu` that costs the compression by default.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from edgc.bench.netns import parse_rate
from edgc.bench.simulate.gpu import GPUSpec, find_gpu
from edgc.fields import reject_unknown_fields
from edgc.models.gpt2 import PRESETS
from edgc.train.config import load_config_file

__all__ = ["ClusterSpec", "bundled_clusters", "load_cluster", "parse_bandwidth"]


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

    gpu: str | None = None
    """The cluster's GPU, a name or alias of `edgc.bench.simulate.gpu.GPUS` ("V100",
    "H100-SXM5"). It picks the roofline cost model `edgc simulate` uses by default; None:
    costs must come from --profile or --device."""

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
        if self.gpu is not None:
            try:
                find_gpu(self.gpu)
            except ValueError as exc:
                raise ValueError(f"ClusterSpec.gpu={self.gpu!r}: {exc}") from None

    @property
    def gpu_spec(self) -> GPUSpec | None:
        """The roofline table's entry for `gpu`, or None when the file names no GPU."""
        return None if self.gpu is None else find_gpu(self.gpu)

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
        assert self.achieved_flops is not None  # (exactly one of the two is given: checked on construction)
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
        with resources.as_file(resources.files("edgc.bench") / "clusters" / f"{name_or_path}.toml") as p:
            values = load_config_file(p)
    else:
        values = load_config_file(path)
    values.setdefault("name", path.stem)
    return ClusterSpec.from_dict(values)
