"""A stated roofline model of a named GPU: the default cost of EDGC's arithmetic on a cluster.

Every operation of a PowerSGD round and of the GDS entropy estimate is written down as
(flops, bytes moved through HBM, kernel launches), and costs

    seconds = max(flops / achievable FLOP/s, bytes / achievable bandwidth) + launches · latency

with achievable = a stated fraction of the vendor's peak (`MATMUL_EFFICIENCY`,
`HBM_EFFICIENCY`). The operations are those edgc.comm.step runs in the compress phase on
B same-shape (m, n) gradient matrices at rank r, split over `units` units a step
(EDGCConfig.max_units), each unit one batch that launches every op once. Gradients and the
wire use g bytes per element; the arithmetic runs in the working dtype of w bytes (float32
for fp16/bf16 gradients, `working_bytes`); the error feedback is kept in g bytes. The matrices
of a unit are costed as gathered from several DDP buckets (a unit of four spans many 25 MB
buckets), an upper bound where a unit is one bucket and the round reads them where they lie:

1. M = G + E: float32 gradients, E added into the gradient (3·B·m·n·w bytes), then M
   gathered into the workspace for each of its three reads (B·m·n·2w each); half gradients,
   M made afresh for each read from G and E (B·m·n·(2g + 3w) each)     1 or 2 launches a read
2. P = M Q (bmm)                      2·B·m·n·r flops, B·(mn + nr + mr)·w bytes, 1 launch
3. P to the wire dtype and back (around its all-reduce, when w ≠ g)
                                                         2·B·m·r·(w + g) bytes, 2 launches
4. orthogonalise P (B, m, r): see `RooflineModel.orthogonalize_ops` (EDGCConfig.orthogonalization)
5. Q = Mᵀ P (bmm)                     2·B·m·n·r flops, B·(mn + mr + nr)·w bytes, 1 launch
6. Q to the wire dtype and back, then Q /= N      2·B·n·r·(w + g) + 2·B·n·r·w bytes, 3 launches
7. keep Q (a copy), and per shape the dead-Q check (norm, ==)   3·B·n·r·w bytes, 1 + 2 launches
8. E = M − P Qᵀ in one baddbmm        2·B·m·n·r flops, B·m·n·(w + g) bytes, 1 launch
9. the average P Qᵀ into the workspace (bmm), then into the buckets (one multi-tensor copy)
                                      2·B·m·n·r flops, B·m·n·(2w + g) bytes, 2 launches

Honest limits of the model, also printed by the report:

- a host sync (`.item()`, `bool(tensor)`) is costed as one launch latency;
- the matmul rate is that of the working dtype: the plain FP32 rate for float32 (torch's
  default float32 matmul precision does not use TF32), the tensor-core rate for half; at
  r ≤ 64 these skinny matmuls sit near the ridge point, so bandwidth often decides them;
- the Householder QR's launch count is an estimate fitted to public timings of
  torch.linalg.qr (see `orthogonalize_ops`), not a count of cuSOLVER's kernels; Cholesky-QR2's
  is its ops counted (13), each taken as one kernel;
- a multi-tensor op (the gathers and scatters) is costed as one launch: torch's
  multi_tensor_apply packs up to a few dozen tensors a launch;
- traffic that would stay in L2 (P inside the Gram-Schmidt loop) is counted at HBM
  bandwidth: an upper bound;
- no overlap between operations, and none with the backward pass.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from edgc.bench.simulate.costs import DDP_BUCKET_BYTES, EntropyCost
from edgc.config import ORTHOGONALIZATIONS, EDGCConfig
from edgc.entropy import ESTIMATORS, sample_stride

logger = logging.getLogger(__name__)

__all__ = [
    "GPUS",
    "HBM_EFFICIENCY",
    "LAUNCH_LATENCY_S",
    "MATMUL_EFFICIENCY",
    "GPUSpec",
    "OpCost",
    "RooflineModel",
    "find_gpu",
    "match_gpu",
    "working_bytes",
]

# ASSUMPTION: the share of the peak matmul rate reached. cuBLAS reaches more on large square
# GEMMs; the GEMMs here are skinny (one side r <= 64) and in float32 sit near the ridge
# point (2r flops per 4-byte element), so compute and bandwidth weigh about equally.
MATMUL_EFFICIENCY = 0.65

# ASSUMPTION: the share of peak HBM bandwidth a streaming kernel reaches; copy/triad
# kernels (STREAM, BabelStream) typically reach 80-90% of the datasheet figure.
HBM_EFFICIENCY = 0.80

# ASSUMPTION: seconds per kernel launch through PyTorch eager, the same on every GPU. CUDA's
# own launch overhead is a few microseconds (NVIDIA Technical Blog, "Getting Started with
# CUDA Graphs", 2019); PyTorch's per-op dispatch on the host is of the same order, and with
# small kernels the GPU waits for it. Not a datasheet figure.
LAUNCH_LATENCY_S = 5e-6

# A GPU reads global memory in 32-byte sectors (CUDA C++ Best Practices Guide, "Coalesced
# Access to Global Memory"): a strided read touches every sector whose stride is below it.
_SECTOR_BYTES = 32

# Householder QR (torch.linalg.qr, mode "reduced", float32) in launch-equivalents of
# LAUNCH_LATENCY_S: per call 6, per matrix 3.5 + 0.75 per column, since ATen loops over the
# batch with one cuSOLVER geqrf and one orgqr call per matrix. Fitted to public timings:
# single fp32 matrices (128, 32) 0.179 ms, (512, 64) 0.259 ms, (4096, 4) 0.074 ms,
# (8192, 8) 0.112 ms (FlagGems PR #5586's torch baseline on an NVIDIA GPU, github.com/
# flagos-ai/FlagGems/pull/5586), and batches of 3x3 matrices, 32: 0.92 ms and 256: 6.9 ms
# (pytorch issue #143281, RTX 3090, torch 2.13). The fit is within about 30% of each.
_QR_LAUNCHES_PER_CALL = 6.0
_QR_LAUNCHES_PER_MATRIX = 3.5
_QR_LAUNCHES_PER_COLUMN = 0.75

# Kernels of one histogram estimate besides the two passes over the sample (edgc.entropy.
# histogram_entropy, counted from its code): aminmax and its 2 host syncs (float() of min
# and max), histc, then on the `bins` counts: to(float64), divide, p > 0, boolean index
# (a nonzero and its host sync), log, multiply, sum, and float() of the sum.
_HISTOGRAM_LAUNCHES = 3 + 1 + 10
# gaussian_entropy: aminmax + 2 host syncs, std + its float() sync.
_GAUSSIAN_LAUNCHES = 3 + 2


@dataclass(frozen=True, kw_only=True)
class GPUSpec:
    """Peak figures of one GPU, as its vendor's datasheet states them."""

    name: str
    """Name used in cluster files and reports, e.g. "V100-SXM2"."""
    aliases: tuple[str, ...]
    """Other names accepted for it ("V100"); also matched inside a CUDA device name."""
    fp32_flops: float
    """Peak dense FP32 FLOP/s without tensor cores."""
    half_flops: float
    """Peak dense tensor-core FLOP/s in `half_dtype` (fp32 accumulate), sparsity excluded."""
    half_dtype: str
    """What a 2-byte gradient is on this GPU: "float16" (no bf16 support) or "bfloat16"."""
    fp64_flops: float
    """Peak dense FP64 FLOP/s, with FP64 tensor cores where the GPU has them (cuBLAS uses
    them for DGEMM): the Cholesky-QR2 of P runs in float64."""
    hbm_bandwidth: float
    """Peak HBM bandwidth, bytes/s."""
    launch_latency: float = LAUNCH_LATENCY_S
    """Seconds per kernel launch or host sync (an assumption, see LAUNCH_LATENCY_S)."""
    source: str
    """The datasheet the peak figures come from."""


GPUS: dict[str, GPUSpec] = {
    spec.name: spec
    for spec in (
        # NVIDIA Tesla V100 GPU datasheet (2020), V100 SXM2 column: single precision 15.7
        # TFLOPS, double precision 7.8, tensor performance 125 TFLOPS (fp16 multiply, fp32
        # accumulate), HBM2 900 GB/s. No bf16.
        GPUSpec(name="V100-SXM2", aliases=("V100",), fp32_flops=15.7e12, half_flops=125e12, fp64_flops=7.8e12,
                half_dtype="float16", hbm_bandwidth=900e9,
                source="NVIDIA Tesla V100 datasheet, SXM2"),
        # NVIDIA A100 Tensor Core GPU datasheet (2021), A100 80GB SXM column: FP32 19.5
        # TFLOPS, FP64 tensor core 19.5, BF16/FP16 tensor core 312 TFLOPS dense (624 with
        # sparsity), HBM2e 2,039 GB/s.
        GPUSpec(name="A100-SXM4", aliases=("A100",), fp32_flops=19.5e12, half_flops=312e12, fp64_flops=19.5e12,
                half_dtype="bfloat16", hbm_bandwidth=2039e9,
                source="NVIDIA A100 datasheet, 80GB SXM"),
        # NVIDIA H100 Tensor Core GPU datasheet (2023), H100 SXM column: FP32 67 TFLOPS, FP64
        # tensor core 67, BF16/FP16 tensor core 1,979 TFLOPS *with sparsity*, so 989.5 dense;
        # HBM3 3.35 TB/s.
        GPUSpec(name="H100-SXM5", aliases=("H100",), fp32_flops=67e12, half_flops=989.5e12, fp64_flops=67e12,
                half_dtype="bfloat16", hbm_bandwidth=3.35e12,
                source="NVIDIA H100 datasheet, SXM"),
        # NVIDIA H200 Tensor Core GPU datasheet (2024), H200 SXM column: FP32 67 TFLOPS, FP64
        # tensor core 67, BF16/FP16 tensor core 1,979 TFLOPS with sparsity, so 989.5 dense;
        # HBM3e 4.8 TB/s.
        GPUSpec(name="H200", aliases=("H200-SXM",), fp32_flops=67e12, half_flops=989.5e12, fp64_flops=67e12,
                half_dtype="bfloat16", hbm_bandwidth=4.8e12,
                source="NVIDIA H200 datasheet, SXM"),
    )
}


def working_bytes(element_bytes: int) -> int:
    """Return the bytes per element of the compression arithmetic for `element_bytes`-byte gradients.

    edgc.comm.hook compresses fp16 and bf16 gradients in float32 (edgc.comm.units.working_dtype: P,
    Q, M + error and the error-feedback buffer), and float32 gradients in float32.
    """
    return 4 if element_bytes == 2 else element_bytes


def find_gpu(name: str) -> GPUSpec:
    """Return the GPUSpec named `name` or one of its aliases (case-insensitive).

    Raises ValueError naming the known GPUs otherwise.
    """
    key = name.strip().upper()
    for spec in GPUS.values():
        if key == spec.name.upper() or key in (a.upper() for a in spec.aliases):
            return spec
    known = ", ".join(f"{s.name} ({'/'.join(s.aliases)})" for s in GPUS.values())
    raise ValueError(f"unknown GPU {name!r}; the roofline table knows {known}")


def match_gpu(device_name: str) -> GPUSpec | None:
    """Return the table's GPU whose name or alias occurs in a CUDA device name, or None.

    "Tesla V100-SXM2-32GB" -> V100-SXM2, "NVIDIA H100 80GB HBM3" -> H100-SXM5.
    """
    text = device_name.upper()
    for spec in GPUS.values():
        if any(a.upper() in text for a in (spec.name, *spec.aliases)):
            return spec
    return None


@dataclass(frozen=True)
class OpCost:
    """One operation of the cost model: what it computes and moves, and how often it launches."""

    name: str
    flops: float
    """Floating-point operations (a multiply-add is 2)."""
    bytes: float
    """Bytes read from and written to HBM."""
    launches: float
    """Kernel launches and host syncs."""
    matmul: bool = False
    """True: the flops run at the matmul rate; False: at the FP32 (CUDA core) rate."""
    fp64: bool = False
    """True: the flops run at the FP64 rate (Cholesky-QR2 works in float64)."""


@dataclass(frozen=True, kw_only=True)
class RooflineModel:
    """The roofline cost model of `gpu` for gradients of `element_bytes` bytes.

    A `CostSource`: `lowrank` and `entropy` return modelled seconds; nothing is timed.
    """

    gpu: GPUSpec
    element_bytes: int = 2
    """Bytes of one gradient element on the wire (the cluster's grad_bytes): 2 or 4."""
    matmul_efficiency: float = MATMUL_EFFICIENCY
    """Achievable fraction of the peak FLOP/s."""
    bandwidth_efficiency: float = HBM_EFFICIENCY
    """Achievable fraction of the peak HBM bandwidth."""
    error_feedback: bool = True
    """Cost the two error-feedback passes (EDGCConfig.use_error_feedback, on by default)."""
    orthogonalization: str = EDGCConfig.orthogonalization
    """How P is orthonormalised (EDGCConfig.orthogonalization): "cholesky" or "householder"."""
    units: int = EDGCConfig.max_units
    """The units a step's matrices of one shape are split over (EDGCConfig.max_units; each
    launches the round's ops once). 0: one unit."""

    exhaustive = True
    measures = False

    def __post_init__(self) -> None:
        if self.element_bytes not in (2, 4):
            raise ValueError(f"the roofline model costs 2- or 4-byte gradients, got grad_bytes={self.element_bytes}")
        for name in ("matmul_efficiency", "bandwidth_efficiency"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"RooflineModel.{name}={value!r}: must be in (0, 1]")
        if self.orthogonalization not in ORTHOGONALIZATIONS:
            raise ValueError(f"RooflineModel.orthogonalization={self.orthogonalization!r}: choose from "
                             f"{ORTHOGONALIZATIONS}")
        if self.units < 0:
            raise ValueError(f"RooflineModel.units={self.units!r}: must be >= 0 (0: one unit)")

    # --- the assumptions

    @property
    def grad_dtype(self) -> str:
        """The gradients' dtype: the GPU's half type for 2 bytes, else float32."""
        return self.gpu.half_dtype if self.element_bytes == 2 else "float32"

    @property
    def work_bytes(self) -> int:
        """Bytes per element of the compression arithmetic (`working_bytes`)."""
        return working_bytes(self.element_bytes)

    @property
    def dtype(self) -> str:
        """The dtype the compression arithmetic runs in."""
        return self.grad_dtype if self.work_bytes == 2 else "float32"

    @property
    def peak_matmul_flops(self) -> float:
        """Peak matmul FLOP/s in the working dtype: tensor cores for half, plain FP32 otherwise."""
        return self.gpu.half_flops if self.work_bytes == 2 else self.gpu.fp32_flops

    @property
    def matmul_flops(self) -> float:
        """Achievable matmul FLOP/s in the working dtype."""
        return self.matmul_efficiency * self.peak_matmul_flops

    @property
    def vector_flops(self) -> float:
        """Achievable FLOP/s of elementwise work and reductions (CUDA cores, FP32 rate)."""
        return self.matmul_efficiency * self.gpu.fp32_flops

    @property
    def bandwidth(self) -> float:
        """Achievable HBM bytes/s."""
        return self.bandwidth_efficiency * self.gpu.hbm_bandwidth

    @property
    def origin(self) -> str:
        return f"roofline:{self.gpu.name}"

    @property
    def detail(self) -> str:
        """The assumption in one line, for the report and the saved profile."""
        kind = "tensor-core" if self.work_bytes == 2 else "FP32 (no TF32)"
        return (
            f"roofline model of {self.gpu.name} ({self.gpu.source} peak figures), not a measurement: "
            f"{self.grad_dtype} gradients compressed in {self.dtype} as edgc's hook does; matmuls at "
            f"{self.matmul_efficiency:.0%} of the {self.peak_matmul_flops / 1e12:g} TFLOP/s {kind} peak = "
            f"{self.matmul_flops / 1e12:.1f} TFLOP/s (tensor-core peak {self.gpu.half_flops / 1e12:g} TFLOP/s "
            f"{self.gpu.half_dtype}, unused here); other arithmetic at {self.matmul_efficiency:.0%} of "
            f"{self.gpu.fp32_flops / 1e12:g} TFLOP/s FP32; HBM at {self.bandwidth_efficiency:.0%} of "
            f"{self.gpu.hbm_bandwidth / 1e9:,.0f} GB/s = {self.bandwidth / 1e9:,.0f} GB/s; "
            f"{self.gpu.launch_latency * 1e6:g} µs per kernel launch or host sync; each op costs "
            "max(flops / FLOP/s, bytes / bandwidth) + launches x latency"
        )

    def seconds(self, op: OpCost) -> float:
        """Return max(flops / FLOP/s, bytes / bandwidth) + launches · latency for `op`."""
        rate = (self.matmul_efficiency * self.gpu.fp64_flops if op.fp64
                else self.matmul_flops if op.matmul else self.vector_flops)
        return max(op.flops / rate, op.bytes / self.bandwidth) + op.launches * self.gpu.launch_latency

    def total_seconds(self, ops: Sequence[OpCost]) -> float:
        """Return the summed seconds of `ops` (no overlap between them)."""
        return sum(self.seconds(op) for op in ops)

    # --- the operations

    def orthogonalize_ops(self, m: int, r: int, batch: int, units: int = 1) -> list[OpCost]:
        """Return the cost of `edgc.compress.orthogonalize_` (the model's orthogonalization) on a
        (batch, m, r) P in the working dtype, split over `units` batches.

        - Cholesky-QR2 (`cholesky_qr2_`): P to float64 and back (2 launches), its columns
          scaled to unit norm (norm, clamp, divide: 3), then twice the Gram matrix PᵀP
          (2·B·m·r² flops in float64, 1 launch), the shift and the Cholesky factor (2) and
          P L⁻ᵀ (B·m·r² flops, 1): 13 launches a batch, the float64 flops at the FP64 rate.
        - Gram-Schmidt for r <= 2 ("householder"): for each column i, vector_norm, clamp_min,
          div_ (3 launches; 2m flops, 3m elements moved), then for the k = r−i−1 later columns
          colᵀ·rest, col·(…), sub_ (3 launches; 4mk flops, 2m + 5mk elements). Summed:
          2·B·m·r² flops, 6r − 3 launches a batch.
        - Householder QR (torch.linalg.qr = cuSOLVER geqrf + orgqr per matrix): 2mr² − 2r³/3
          flops each (LAPACK Working Note 41's counts for xGEQRF and, with k = n, xORGQR);
          bytes: the m×r matrix read and written once by each of the two (a floor: the
          panel stays in cache) plus the copy back into P; launches: 6 + B·(3.5 + 0.75·r)
          launch-equivalents a batch, fitted to public torch.linalg.qr timings (see
          _QR_LAUNCHES_PER_CALL), plus 1 for the copy back.
        """
        b, w, u = batch, self.work_bytes, units
        if self.orthogonalization == "cholesky":
            x = b * m * r  # elements of P
            return [
                OpCost("orthogonalise: P to float64 and back", 0.0, 2 * x * (w + 8), 2 * u),
                OpCost("orthogonalise: columns to unit norm", 3.0 * x, 3 * x * 8, 3 * u),
                OpCost("orthogonalise: Gram matrices P^T P (x2)", 2 * 2.0 * x * r, 2 * (x + b * r * r) * 8, 2 * u,
                       fp64=True),
                OpCost("orthogonalise: shift and Cholesky (x2)", 2 * b * r**3 / 3, 2 * 2 * b * r * r * 8, 4 * u,
                       fp64=True),
                OpCost("orthogonalise: P L^-T (x2)", 2 * 1.0 * x * r, 2 * 2 * x * 8, 2 * u, fp64=True),
            ]
        if r <= 2:
            flops = 2.0 * b * m * r * r
            pairs = r * (r - 1) / 2  # Σ_i (r − i − 1)
            elements = b * (3 * m * r + 2 * m * (r - 1) + 5 * m * pairs)
            return [OpCost("orthogonalise P (Gram-Schmidt)", flops, elements * w, (6 * r - 3) * u, matmul=True)]
        flops = b * (4.0 * m * r * r - 4.0 * r**3 / 3)
        launches = u * (_QR_LAUNCHES_PER_CALL + 1) + b * (_QR_LAUNCHES_PER_MATRIX + _QR_LAUNCHES_PER_COLUMN * r)
        return [OpCost("orthogonalise P (Householder QR)", flops, b * (4 + 2) * m * r * w, launches)]

    def lowrank_ops(self, m: int, n: int, rank: int, batch: int) -> list[OpCost]:
        """Return the operations of one PowerSGD round over `batch` (m, n) matrices at `rank`,
        split over min(units, batch) units a step.

        The rank is clipped to min(rank, m, n) as the hook does. See the module docstring
        for the list.
        """
        r, g, w, b = min(rank, m, n), self.element_bytes, self.work_bytes, batch
        u = max(1, min(self.units or 1, b))  # each unit launches every op once
        mn = b * m * n
        cast = w != g  # half gradients: M made in the working dtype, factors cast around the wire
        ops = []
        if not cast:
            if self.error_feedback:
                ops.append(OpCost("error feedback in (G += E)", mn, 3 * mn * w, u))
            ops.append(OpCost("gather M into the workspace (x3)", 0.0, 3 * 2 * mn * w, 3 * u))
        else:
            made = mn * (2 * g + 3 * w) if self.error_feedback else mn * (g + w)
            ops.append(OpCost("make M = G + E in the working dtype (x3)", 3 * mn if self.error_feedback else 0.0,
                              3 * made, 3 * (2 if self.error_feedback else 1) * u))
        ops.append(OpCost("P = M Q", 2.0 * mn * r, b * (m * n + n * r + m * r) * w, u, matmul=True))
        if cast:
            ops.append(OpCost("P to the wire dtype and back", 0.0, 2 * b * m * r * (w + g), 2 * u))
        ops += [
            *self.orthogonalize_ops(m, r, b, u),
            OpCost("Q = M^T P", 2.0 * mn * r, b * (m * n + m * r + n * r) * w, u, matmul=True),
            OpCost("Q to the wire dtype and back, Q /= N", b * n * r,
                   (2 * b * n * r * (w + g) if cast else 0) + 2 * b * n * r * w, (3 if cast else 1) * u),
            OpCost("keep Q, dead-Q check", 2.0 * b * n * r, 3 * b * n * r * w, u + 2),
        ]
        if self.error_feedback:
            ops.append(OpCost("error feedback out (E = M - P Q^T, one baddbmm)", 2.0 * mn * r,
                              b * (m * r + n * r) * w + mn * (w + g), u, matmul=True))
        ops.append(OpCost("the average P Q^T into the buckets", 2.0 * mn * r,
                          b * (m * r + n * r) * w + mn * (2 * w + g), 2 * u, matmul=True))
        return ops

    def gds_ops(self, numel: float, rate: float, estimator: str, bins: int) -> list[OpCost]:
        """Return the operations of one GDS entropy step over `numel` gradient elements.

        As `edgc.comm.hook` runs it on a control step: the non-finite check of every bucket
        (isfinite, all, bool: 3 launches per bucket, one read of the gradient), the strided
        sample of every k-th element (k = round(1/β); one copy per bucket, widened to
        float32), then the estimator on the sample. Buckets are counted as numel·g / 25 MiB
        (DDP's default bucket size), fractionally, so the cost is affine in numel. A strided
        read with k·g <= 32 bytes touches every 32-byte sector, so it reads the whole gradient.
        """
        if estimator not in ESTIMATORS:
            raise ValueError(f"entropy_estimator must be one of {ESTIMATORS}, got {estimator!r}")
        e = self.element_bytes
        k = sample_stride(rate)
        s = numel / k  # sampled elements, float32
        buckets = numel * e / DDP_BUCKET_BYTES
        read = numel * e if k * e <= _SECTOR_BYTES else s * _SECTOR_BYTES
        ops = [
            OpCost("non-finite check", numel, numel * e, 3 * buckets),
            OpCost("sample every k-th element", 0.0, read + 4 * s, buckets),
        ]
        if estimator == "histogram":
            ops += [
                OpCost("min/max of the sample", 2 * s, 4 * s, 3),
                OpCost("histc", 2 * s, 4 * s + 4 * bins, 1),
                OpCost("entropy of the bins", 10.0 * bins, 40.0 * bins, _HISTOGRAM_LAUNCHES - 4),
            ]
        else:
            ops += [
                OpCost("min/max of the sample", 2 * s, 4 * s, 3),
                OpCost("std of the sample", 3 * s, 4 * s, _GAUSSIAN_LAUNCHES - 3),
            ]
        return ops

    # --- CostSource

    def lowrank(self, m: int, n: int, ranks: Sequence[int], batch: int) -> dict[int, float]:
        """Return {rank: modelled seconds of one round over `batch` (m, n) matrices}."""
        return {r: self.total_seconds(self.lowrank_ops(m, n, r, batch)) for r in ranks}

    def entropy(self, rate: float, estimator: str, bins: int) -> EntropyCost:
        """Return the modelled GDS cost as fixed + per-element seconds (exact: the model is affine)."""
        fixed = self.total_seconds(self.gds_ops(0, rate, estimator, bins))
        probe = float(1 << 30)
        slope = (self.total_seconds(self.gds_ops(probe, rate, estimator, bins)) - fixed) / probe
        if not (math.isfinite(slope) and slope >= 0):
            raise ArithmeticError(f"GDS cost slope {slope!r} is not a non-negative number")
        return EntropyCost(fixed, slope)
