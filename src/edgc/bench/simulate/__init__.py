"""`edgc simulate`: an α–β projection of per-step DP sync and training time onto a cluster.

Nothing here talks to a network. The pieces, one module each:

- `cluster`: `ClusterSpec`, the cluster and job (TOML files in `edgc/bench/clusters/`, two
  of them the paper's setups), including the GPU it runs on;
- `layout`: the gradient shard each GPU all-reduces, from the model's real parameter
  shapes (`build_model(preset, device="meta")`) in a Megatron TP x PP layout;
- `gpu`: the roofline table of GPUs (vendor peak figures, stated achievable fractions,
  launch latency) and the cost of every operation of a PowerSGD round and of the GDS;
- `profile`: `CostProfile`, the compression costs the projection uses, filled by the
  roofline model (the default for a cluster that names its GPU) or timed on a local device
  (`DeviceTimer`: `--device cuda`, or explicitly `--device cpu`), saved and loaded as JSON
  with where each number came from;
- `model`: the α–β model, each stage's sync, the 1F1B exposure, and the projection of the
  methods over a whole run (`simulate`);
- `report`: the markdown report, which opens with where the compression costs came from;
- `command`: `add_parser` and `run` for the CLI.

Simplifications are listed where they are made and printed by `run` under "Assumptions".
"""

from edgc.bench.simulate.cluster import ClusterSpec, bundled_clusters, load_cluster, parse_bandwidth
from edgc.bench.simulate.command import add_parser, cost_source, run
from edgc.bench.simulate.costs import CostSource, EntropyCost
from edgc.bench.simulate.gpu import GPUS, GPUSpec, OpCost, RooflineModel, find_gpu, match_gpu
from edgc.bench.simulate.layout import StageGradients, stage_gradients
from edgc.bench.simulate.model import (
    PAPER_COMM_REDUCTION,
    PAPER_TIME_REDUCTION,
    MethodProjection,
    Projection,
    SimOptions,
    StageSync,
    StepProjection,
    compressed_matrices,
    parse_schedule,
    profile_needs,
    ring_allreduce_time,
    simulate,
    stage_sync,
    wire_crossover_rank,
)
from edgc.bench.simulate.profile import CostProfile, DeviceTimer
from edgc.bench.simulate.report import format_projection

__all__ = [
    "GPUS",
    "PAPER_COMM_REDUCTION",
    "PAPER_TIME_REDUCTION",
    "ClusterSpec",
    "CostProfile",
    "CostSource",
    "DeviceTimer",
    "EntropyCost",
    "GPUSpec",
    "MethodProjection",
    "OpCost",
    "Projection",
    "RooflineModel",
    "SimOptions",
    "StageGradients",
    "StageSync",
    "StepProjection",
    "add_parser",
    "bundled_clusters",
    "compressed_matrices",
    "cost_source",
    "find_gpu",
    "format_projection",
    "load_cluster",
    "match_gpu",
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
