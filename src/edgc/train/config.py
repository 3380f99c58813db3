"""TrainConfig: everything one `edgc train` run needs, validated before any worker starts."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from edgc.config import EP_WIRES, MAX_RANK, SEED_LIMIT, EDGCConfig, run_scaled
from edgc.fields import check_field_types, reject_unknown_fields
from edgc.models import PRESETS
from edgc.policy.dac import DACConfig
from edgc.train import layout_checks
from edgc.train.config_file import check_folder_path, load_config_file
from edgc.train.layout_checks import DILOCO_METHODS, expert_config

__all__ = ["DILOCO_METHODS", "METHODS", "TrainConfig", "load_config_file", "process_group_backend"]

METHODS = ("none", "powersgd", "torch-powersgd", "edgc", "compute-only", "diloco", "edgc-diloco")
SCHEDULES = ("1f1b", "gpipe")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("fp32", "bf16", "fp16")
TOKENIZERS = ("bpe", "gpt2")
LOGS = ("jsonl", "tensorboard")
LR_SCHEDULES = ("cosine", "step")
#: The largest DDP bucket taken, in MB (1 TiB): DDP holds the size as a 64-bit byte count.
MAX_BUCKET_MB = 2.0**20
#: The longest emulated device time per block taken, in ms (edgc.train.emulate).
MAX_EMULATED_MS = 10_000.0


def process_group_backend(device_type: str, local_world: int, gpus: int) -> str:
    """NCCL when this machine's `local_world` workers each have one of its `gpus` GPUs, else
    gloo (which carries CUDA tensors too): NCCL refuses two ranks on one GPU ("Duplicate
    GPU detected"), as when torchrun starts 2 workers on a 1-GPU machine."""
    return "nccl" if device_type == "cuda" and 0 < local_world <= gpus else "gloo"


@dataclass(kw_only=True)
class TrainConfig:
    """One training run. Fields left at None are derived from the run length (`resolve`)."""

    #: The values each text field may take (validate checks them; the CLI lists them).
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "preset": tuple(PRESETS), "method": METHODS, "device": DEVICES, "dtype": DTYPES,
        "tokenizer": TOKENIZERS, "schedule": SCHEDULES, "log": LOGS, "lr_schedule": LR_SCHEDULES,
        "ep_wire": EP_WIRES,
    }
    #: How `edgc train --help` groups the fields, each field in one group, in this order
    #: (the "edgc" and "dac" tables have groups of their own).
    GROUPS: ClassVar[dict[str, tuple[str, ...]]] = {
        "model and gradient sync": ("preset", "method", "rank", "bucket_cap_mb", "device", "dtype", "compile",
                                    "emulated_device_ms"),
        "DiLoCo (--method diloco or edgc-diloco)": ("diloco_inner_steps", "diloco_outer_lr",
                                                    "diloco_outer_momentum"),
        "workers and parallel layout": ("nproc", "dp_shard", "dp_replicate", "tp", "ep", "ep_wire",
                                        "sequence_parallel", "vocab_parallel", "pp", "dp", "schedule", "microbatches",
                                        "sync_after_send", "activation_rank"),
        "optimisation": ("steps", "stop_after", "batch_size", "grad_accum", "block_size", "lr", "lr_schedule",
                         "min_lr", "lr_warmup_steps", "lr_drop_steps", "lr_drop_gamma", "weight_decay", "grad_clip",
                         "seed", "max_nonfinite_steps"),
        "data": ("data", "tokenizer", "vocab_size", "corpus_bytes", "data_cache"),
        "evaluation": ("eval_every", "eval_tokens"),
        "run folder, logging and checkpoints": ("out", "log", "progress", "checkpoint_every", "keep_checkpoints",
                                                "max_restarts", "trust_checkpoint"),
    }
    #: The EDGCConfig defaults that `edgc_config` scales to the run, in words (the CLI's
    #: help shows them in place of EDGCConfig's own defaults).
    SCALED_EDGC_DEFAULTS: ClassVar[dict[str, str]] = {
        "policy": f'"static" with --method powersgd, else "{EDGCConfig().policy}"', "max_rank": "--rank",
        "window": "steps // 15, at least 5", "iteration_sample_rate": "5 / window, in [0.1, 1]",
        "warmup_steps": "steps // 10, at least 1", "seed": "--seed",
        "warmup_min_steps": "the learning rate's warm-up (--lr-warmup-steps), at most warmup_steps",
        "long_rank_factor": f"1 with --method powersgd, else {EDGCConfig().long_rank_factor}"}
    #: Placeholders for values that are not plain text (the CLI's help shows them).
    METAVARS: ClassVar[dict[str, str]] = {"data": "DIR", "data_cache": "DIR", "out": "DIR", "lr_drop_steps": "STEP,..."}

    preset: str = "tiny"
    """Model preset (edgc.models.PRESETS)."""

    method: str = "edgc"
    """Gradient sync: "none" (plain all-reduce), "powersgd" (our compressor, static rank),
    "torch-powersgd" (PyTorch's own hook, made safe for gloo) or "edgc". "diloco" syncs
    every `diloco_inner_steps` steps instead: the weights' change averaged, then an outer
    Nesterov step (edgc.diloco); "edgc-diloco" sends that change through edgc's compressor.
    "compute-only" syncs nothing, so the replicas drift apart: not a way to train, but the
    step time without communication that `edgc bench train` subtracts to measure the
    others' exposed communication."""

    diloco_inner_steps: int | None = None
    """H, the local steps between DiLoCo's syncs. None: steps // 100, at least 1: about 100
    outer steps a run for the outer momentum to act over (docs/diloco.md)."""

    diloco_outer_lr: float = 0.7
    """DiLoCo's outer learning rate, > 0: the paper's 0.7, for H = 500 (docs/diloco.md: lower at short H)."""

    diloco_outer_momentum: float = 0.9
    """DiLoCo's outer Nesterov momentum (the paper's 0.9), in [0, 1); 0: plain SGD."""

    nproc: int | None = None
    """Local workers started by `edgc train` (ignored under torchrun, which sets the world).
    None: dp_shard * (dp_replicate, or dp, or 2) * tp for an FSDP2 run (`hsdp`), else
    pp * dp * tp when dp is given, pp * tp when pp > 1 (one replica per stage), else 2."""

    device: str = "auto"
    """Where the workers train: "auto" (CUDA when a GPU is visible, else the CPU), "cpu"
    or "cuda". Local workers on CUDA use NCCL when each has a GPU of its own, and gloo
    (which carries CUDA tensors) when they must share; under torchrun, NCCL on CUDA."""

    dtype: str = "fp32"
    """Compute precision: "fp32", "bf16" (autocast) or "fp16" (autocast and a GradScaler).
    Parameters, gradients and optimiser state stay float32, as in torch's AMP recipe."""

    compile: bool = False
    """Compile each transformer block with torch.compile (its default backend, inductor)
    before the model is made data-parallel, as torchtitan does: the first steps compile,
    the later ones run the compiled code. The communication hook, DDP's reducer and FSDP's
    collectives stay outside the compiled code, and the parameters keep their names, so a
    checkpoint is the same with or without it (a resumed run may change it). The losses
    match an eager run's up to float rounding: the compiler fuses and reorders."""

    emulated_device_ms: float = 0.0
    """For benchmarks on a CPU machine: every transformer block waits this many ms, idle,
    after its forward pass and twice that before its backward pass, as a host waits for its
    accelerator, so that communication can overlap as on a GPU (edgc.train.emulate). The
    maths is unchanged. 0: off; at most 10000."""

    steps: int = 300
    """Optimiser steps. A resume may change it: the run goes on to the new last step, its
    cosine learning rate worked out over the new length from the next step on, the rest of
    its schedule as the first length set it (docs/checkpoints.md)."""

    stop_after: int | None = None
    """Stop after this step with a checkpoint, as a time-limited job would; continue later
    with --resume (the schedule still runs to `steps`)."""

    batch_size: int = 8
    """Sequences per worker per micro-step."""

    grad_accum: int = 1
    """Micro-steps per optimiser step (the hook runs on the last one only)."""

    block_size: int | None = None
    """Context length; None: the preset's."""

    lr: float = 1e-3
    """Peak learning rate of AdamW."""

    lr_schedule: str = "cosine"
    """After the warm-up: "cosine" (decay to min_lr by the last step) or "step" (lr, times
    lr_drop_gamma at each of lr_drop_steps; min_lr does not apply)."""

    min_lr: float | None = None
    """Floor of the cosine decay; None: lr / 10."""

    lr_warmup_steps: int | None = None
    """Linear learning-rate warm-up; None: 5% of steps (paper: 1% of a much longer run)."""

    lr_drop_steps: str = ""
    """For lr_schedule "step": the steps "STEP,..." (e.g. "600,800") from which the learning
    rate is multiplied by lr_drop_gamma, once more at each; increasing positive integers.
    Only with "step"."""

    lr_drop_gamma: float = 0.1
    """For lr_schedule "step": the factor each drop multiplies the learning rate by, in (0, 1)."""

    weight_decay: float = 0.01
    """AdamW weight decay (paper: 0.01); a finite number >= 0."""

    grad_clip: float = 1.0
    """Clip the global gradient norm to this (paper: 1.0); 0 disables clipping. A finite
    number >= 0."""

    eval_every: int | None = None
    """Validation every N steps (and at the end); None: steps // 6."""

    eval_tokens: int | None = 524_288
    """Validation tokens per evaluation, at most: the validation split cut into
    non-overlapping blocks of block_size, spread evenly over it when there are more than
    this, shared out over the data-parallel replicas, the same blocks at every evaluation
    and in every run on the same data (edgc.train.evaluation). None: every block."""

    checkpoint_every: int | None = None
    """Checkpoint every N steps (and at the end); None: steps // 3."""

    seed: int = 1337
    """Seed of the model init and of every worker's batch sampler, in [0, 2**32)."""

    data: str | None = None
    """A folder made by `edgc prepare` (train.bin, val.bin, meta.json); None: the built-in
    corpus, prepared once into `data_cache`."""

    tokenizer: str = "bpe"
    """For the built-in corpus: "bpe" (small local BPE, fast on CPU) or "gpt2"."""

    vocab_size: int = 2048
    """Size of the local BPE when tokenizer is "bpe"."""

    corpus_bytes: int | None = None
    """Cap on the built-in corpus in bytes: the alphabetically first files of its selection
    (None: all of it, about 9 MB on CPython 3.11, which the validation split needs to be
    large enough; see edgc.data.corpus.BUILTIN_VAL_FRACTION)."""

    data_cache: str = "runs/.data"
    """Where the built-in corpus is tokenised to, once (a folder, or a path where one can be made)."""

    out: str = "runs/edgc"
    """The run folder: a folder, or a path where one can be made (not a file, nor under one)."""

    rank: int = 32
    """r_max for "edgc", and the fixed rank of "powersgd" and "torch-powersgd" (release
    default: 32), at most MAX_RANK (65536)."""

    bucket_cap_mb: float = 25.0
    """DDP bucket size in MB, in (0, 2**20]."""

    progress: bool = True
    """Show a live progress bar on rank 0."""

    log: str = "jsonl"
    """Where rank 0 logs each step besides the console: "jsonl" (metrics.jsonl) or
    "tensorboard" (metrics.jsonl, and the same scalars as TensorBoard event files in
    `out`/tensorboard; needs the tensorboard package: pip install 'edgc[tensorboard]')."""

    edgc: dict[str, Any] = field(default_factory=dict)
    """EDGCConfig overrides (any field); unspecified ones are scaled to the run (`resolve`)."""

    dp_shard: int = 1
    """FSDP2 shard size: with S > 1 (or with dp_replicate given) the model is sharded with
    fully_shard over S workers (a node), and replicated dp_replicate times (the nodes):
    HSDP. Method "none" is native HSDP; "powersgd" and "edgc" shard on the 1-D shard mesh
    and compress the replicas' all-reduce through edgc.fsdp.register_edgc."""

    dp_replicate: int | None = None
    """HSDP replicas (nodes) of each shard group; None: world // dp_shard. dp_shard *
    dp_replicate must equal the world."""

    tp: int = 1
    """Tensor-parallel ranks per model replica: torch's DTensor tensor parallelism splits
    each GPT-2 block's attention heads and MLP over T adjacent workers (and the token
    embedding and head on the vocabulary: vocab_parallel). With T > 1 the model goes
    through FSDP2 (shard size dp_shard, 1 by default; replicas dp_replicate or dp) and edgc
    compresses each TP rank's shards over its own replicate group. The world is replicas *
    dp_shard * tp."""

    ep: int = 1
    """Expert-parallel ranks, for a preset with experts (tiny-moe, small-moe): each of E
    adjacent replicas holds n_expert / E of every block's experts, and tokens reach them by
    all-to-all. The run goes through FSDP2 as with --dp-shard: the dense parameters are
    averaged over every replica, the experts over the replicas holding the same ones
    (replicas / E), each group compressed by edgc with its own rank (edgc.moe,
    docs/moe.md). E must divide the replicas and the experts."""

    expert_edgc: dict[str, Any] = field(default_factory=dict)
    """EDGCConfig overrides (any field) for the experts' own compression core: a preset
    with experts in an FSDP2 run (ep > 1, or dp_shard / dp_replicate), method "powersgd"
    or "edgc". Each field not given is the run's (`edgc`, scaled to the run). E.g.
    {"min_rank": 16} keeps the experts' rank at 16 or more; {"warmup": "fixed",
    "warmup_steps": 10**9, "wire": "native"} sends them whole every step (docs/moe.md)."""

    ep_wire: str = "native"
    """With ep > 1, the format the experts' all-to-all sends the tokens' hidden states and
    their gradients in: "native" (as computed) or "int8" (a byte a value and a bfloat16
    scale a block of 32, as edgc's int8 wire; edgc.moe.ExpertParallel)."""

    sequence_parallel: bool = False
    """With tp > 1: split the norms and the residual stream between the blocks on the
    sequence over the TP ranks (torch's SequenceParallel) instead of holding them whole."""

    vocab_parallel: bool = True
    """With tp > 1: split the token embedding and the head tied to it on the vocabulary over
    the TP ranks (as Megatron and torchtitan do); false holds them whole on each TP rank,
    which sends more bytes at the same loss (docs/tensor-parallel.md). No effect at tp = 1."""

    pp: int = 1
    """Pipeline stages. With pp > 1 the GPT-2 blocks are split into pp stages
    (torch.distributed.pipelining); stage 0 holds the embedding, the last the head."""

    dp: int | None = None
    """Data-parallel replicas of each stage; None: world // pp. pp * dp must equal the world."""

    schedule: str = "1f1b"
    """Pipeline schedule with pp > 1: "1f1b" or "gpipe"."""

    microbatches: int | None = None
    """Micro-batches per step with pp > 1 (batch_size must divide by it); None: 2 * pp."""

    sync_after_send: bool = True
    """With pp > 1: run each stage's DP sync after its last input-gradient send, so the
    stages' syncs overlap (see edgc.comm.pipeline); False keeps torch's placement inside
    the last backward pass."""

    activation_rank: int = 0
    """With pp > 1: send the activation gradients between stages as rank-r factors with
    error feedback (beyond the EDGC release, as Optimus-CC does); 0 sends them whole.
    At most MAX_RANK (65536)."""

    dac: dict[str, Any] = field(default_factory=dict)
    """DACConfig overrides (edgc.policy.dac) for the stage ranks of "edgc" and "powersgd"
    with pp > 1."""

    keep_checkpoints: int = 1
    """Checkpoints kept: `checkpoint.pt` is always the newest; with K > 1 the newest K are
    also kept as `checkpoint-STEP.pt`, and any of them can be resumed with --resume FILE."""

    max_restarts: int = 0
    """Local launcher: when a worker dies (killed, out of memory, a lost peer), restart the
    job from the last checkpoint, up to this many times. Under torchrun use its own
    --max-restarts with --auto-resume."""

    trust_checkpoint: bool = False
    """Resume from a checkpoint that names Python objects other than tensors and plain
    values: loading it calls them, which can run any code, so give it only for a file you
    trust. Without it such a checkpoint is refused unloaded, naming what it holds. Not
    kept: a later resume must give it again."""

    max_nonfinite_steps: int = 25
    """Stop the run when the loss or gradient norm is not finite for this many steps in a
    row (updates are skipped meanwhile, and no checkpoint is written from a non-finite
    model). fp16 skips a few steps in a row by design while its loss scale comes down."""

    def builtin_data_folder(self) -> Path:
        """Where the built-in corpus is (or will be) prepared for this run's tokenizer, in
        `data_cache` (edgc.data.builtin_folder)."""
        from edgc.data.prepare import builtin_folder

        return builtin_folder(self.data_cache, self.tokenizer, self.vocab_size, self.corpus_bytes)

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field and saying what it may be: its
        type first (no bool for an int, no NaN or infinity for a number, a table for
        `edgc` and `dac`), then its range, then the layout. Checks paths but writes nothing."""
        bad = self._refuse
        check_field_types(self, bad)
        for name in ("steps", "batch_size", "grad_accum", "rank", "vocab_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                bad(name, "must be a positive integer")
        for name in ("nproc", "block_size", "eval_every", "eval_tokens", "checkpoint_every", "corpus_bytes",
                     "stop_after"):
            value = getattr(self, name)
            if value is not None and value < 1:
                bad(name, "must be a positive integer or null (unset)")
        if self.lr_warmup_steps is not None and self.lr_warmup_steps < 0:
            bad("lr_warmup_steps", "must be an integer >= 0 or null (unset)")
        for name in ("rank", "activation_rank"):
            if getattr(self, name) > MAX_RANK:
                bad(name, f"must be at most {MAX_RANK}")
        if not 0 <= self.seed < SEED_LIMIT:
            bad("seed", "must be an integer in [0, 2**32)")
        if not self.lr > 0:
            bad("lr", "must be positive")
        if self.min_lr is not None and not 0 <= self.min_lr <= self.lr:
            bad("min_lr", f"must be in [0, lr={self.lr}]")
        try:
            drops = self.lr_drops()
        except ValueError as exc:
            bad("lr_drop_steps", str(exc))
        if self.lr_schedule == "step" and not drops:
            bad("lr_drop_steps", 'lr_schedule "step" needs at least one step to drop at ("STEP,...")')
        if self.lr_schedule != "step" and drops:
            bad("lr_drop_steps", f'applies only to lr_schedule "step" (this run\'s is "{self.lr_schedule}")')
        if not 0 < self.lr_drop_gamma < 1:
            bad("lr_drop_gamma", "must be in (0, 1)")
        for name in ("weight_decay", "grad_clip"):
            if getattr(self, name) < 0:
                bad(name, "must be >= 0")
        if not 0 <= self.emulated_device_ms <= MAX_EMULATED_MS:
            bad("emulated_device_ms", f"must be in [0, {MAX_EMULATED_MS:.0f}] (ms)")
        if not 0 < self.bucket_cap_mb <= MAX_BUCKET_MB:
            bad("bucket_cap_mb", f"must be in (0, {MAX_BUCKET_MB:.0f}] (MB)")
        check_folder_path("out", self.out, writable=True)
        if self.data is None:
            # (written only when the built-in corpus is still to be prepared there)
            prepared = (self.builtin_data_folder() / "meta.json").is_file()
            check_folder_path("data_cache", self.data_cache, writable=not prepared)
        if self.device == "cuda" and not torch.cuda.is_available():
            bad("device", "no CUDA device is visible here (torch.cuda.is_available() is False); use cpu or auto")
        if self.data is not None and not (Path(self.data) / "meta.json").is_file():
            raise ValueError(
                f"data={self.data!r}: no prepared data there (expected meta.json, train.bin, val.bin); "
                f"make it with: edgc prepare TEXT_FILES_OR_FOLDERS --out {self.data}"
            )
        layout_checks.check_diloco_layout(self, bad)  # (before edgc_config, which counts edgc-diloco's outer steps)
        for table in ("edgc", "expert_edgc"):
            if getattr(self, table).get("total_steps") is not None:
                bad(table, "total_steps is the run's --steps here; the run scales the window and warm-up to it")
        self.edgc_config()  # raises ValueError naming the EDGCConfig field
        self.dac_config()
        if self.microbatches is not None and self.pp == 1:
            bad("microbatches", "splits a pipeline's step: it needs pp > 1")
        for name in ("pp", "dp_shard", "tp", "ep"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                bad(name, "must be a positive integer")
        for name in ("dp", "microbatches", "dp_replicate"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                bad(name, "must be a positive integer or unset")
        for name in ("keep_checkpoints", "max_nonfinite_steps"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                bad(name, "must be a positive integer")
        if type(self.max_restarts) is not int or self.max_restarts < 0:
            bad("max_restarts", "must be an integer >= 0")
        if not isinstance(self.activation_rank, int) or self.activation_rank < 0:
            bad("activation_rank", "must be an integer >= 0")
        if self.activation_rank and self.pp == 1:
            bad("activation_rank", "compresses traffic between pipeline stages: it needs pp > 1")
        world = self.pp * (self.dp or 0) * self.tp
        if self.nproc is not None and self.dp is not None and not self.hsdp and world != self.nproc:
            tp, times = (f" * tp({self.tp})", " * tp") if self.tp > 1 else ("", "")
            bad("nproc", f"pp({self.pp}) * dp({self.dp}){tp} != world({self.nproc}): the layout must use every "
                         f"worker exactly once (without --nproc, edgc train starts pp * dp{times} = {world})")
        if self.compile and not self.hsdp and self.bucket_cap_mb < 1:
            bad("bucket_cap_mb", "must be at least 1 with --compile: torch.compile splits a DDP model's graph at "
                                 "buckets of this size and refuses any smaller than 1 MB")
        if self.log == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
            bad("log", "the tensorboard package is not installed; install it with: pip install 'edgc[tensorboard]'")
        layout_checks.check_tp_layout(self, bad)
        layout_checks.check_expert_layout(self, bad)
        layout_checks.check_hsdp_layout(self, bad)
        layout_checks.check_pipeline_layout(self, bad)

    def lr_drops(self) -> list[int]:
        """The steps of `lr_drop_steps`, in order; raises ValueError unless they are
        increasing positive integers separated by commas ("" gives [])."""
        steps: list[int] = []
        for part in self.lr_drop_steps.split(","):
            part = part.strip()
            if not part and not self.lr_drop_steps.strip():
                continue
            if not (part.isascii() and part.isdigit() and len(part) <= 18) or int(part) < 1:
                raise ValueError(f"{part!r} is not a step: expected positive integers \"STEP,...\" (e.g. \"600,800\")")
            if steps and int(part) <= steps[-1]:
                raise ValueError(f"the steps must increase: {int(part)} follows {steps[-1]}")
            steps.append(int(part))
        return steps

    def resolved_inner_steps(self) -> int:
        """DiLoCo's H: as given, else steps // 100 (at least 1)."""
        return self.diloco_inner_steps if self.diloco_inner_steps is not None else max(1, self.steps // 100)

    def resolved_device(self) -> str:
        """"cpu" or "cuda": `device`, with "auto" decided by whether a GPU is visible."""
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def backend(self, world: int) -> str:
        """The process-group backend for `world` local workers on this config's device
        (process_group_backend)."""
        return process_group_backend(self.resolved_device(), world, torch.cuda.device_count())

    def workers(self) -> int:
        """The local workers `edgc train` starts: `nproc`, or when unset (see `nproc`)
        dp_shard * (dp_replicate, or dp, or 2) * tp under FSDP2, pp * dp * tp (dp given),
        pp * tp (pp > 1: one replica per stage), or 2."""
        if self.nproc is not None:
            return self.nproc
        if self.hsdp:
            return self.dp_shard * (self.dp_replicate or self.dp or 2) * self.tp
        if self.dp is not None:
            return self.pp * self.dp * self.tp
        return self.pp * self.tp if self.pp > 1 else 2

    @property
    def hsdp(self) -> bool:
        """Whether the run shards the model with FSDP2 (dp_shard > 1, dp_replicate given, or
        tensor parallelism)."""
        return (self.dp_shard != 1 or self.dp_replicate is not None or (self.tp > 1 and self.pp == 1)
                or self.ep > 1)

    def hsdp_layout(self, world: int) -> tuple[int, ...]:
        """(replicate, shard) of an HSDP run on `world` workers, and tp after them when
        tp > 1; raises ValueError unless they use every worker exactly once."""
        given = self.dp_replicate if self.dp_replicate is not None else self.dp
        replicate = given if given is not None else world // (self.dp_shard * self.tp)
        if replicate >= 1 and replicate * self.dp_shard * self.tp == world and replicate % self.ep:
            raise ValueError(f"ep({self.ep}) must divide the {replicate} replicas of the {world} workers "
                             f"(world = replicas * dp_shard({self.dp_shard}))")
        if replicate * self.dp_shard * self.tp != world or replicate < 1:
            name = "dp_replicate" if self.dp_replicate is not None or self.dp is None else "dp"
            tp = f" * tp({self.tp})" if self.tp > 1 else ""
            raise ValueError(f"{name}({replicate}) * dp_shard({self.dp_shard}){tp} != world({world}): "
                             "the layout must use every worker exactly once")
        return (replicate, self.dp_shard, self.tp) if self.tp > 1 else (replicate, self.dp_shard)

    def check_layout(self, world: int) -> None:
        """Raise ValueError unless pp * dp (or under HSDP dp_replicate * dp_shard * tp) == world,
        showing the arithmetic."""
        if self.hsdp:
            self.hsdp_layout(world)
            return
        dp = self.dp if self.dp is not None else world // (self.pp * self.tp)
        if self.pp * dp * self.tp != world or dp < 1:
            tp = f" * tp({self.tp})" if self.tp > 1 else ""
            raise ValueError(f"pp({self.pp}) * dp({dp}){tp} != world({world}): "
                             "the layout must use every worker exactly once")

    def pipeline_layout(self, world: int) -> tuple[int, ...]:
        """(pp, dp) of a run on `world` workers, or (pp, dp, tp) with tensor parallelism
        (what its checkpoints record)."""
        dp = world // (self.pp * self.tp)
        return (self.pp, dp, self.tp) if self.tp > 1 else (self.pp, dp)

    def dac_config(self) -> DACConfig:
        """The DACConfig of this run (defaults plus `dac` overrides); raises ValueError by name."""
        return DACConfig.from_dict(dict(self.dac))

    def resolve(self) -> TrainConfig:
        """A copy with every None default filled in from the run length."""
        c = dataclasses.replace(self, edgc=dict(self.edgc), dac=dict(self.dac), expert_edgc=dict(self.expert_edgc))
        preset = PRESETS[c.preset]
        c.device = c.resolved_device()
        c.nproc = c.workers()
        if c.block_size is None:
            c.block_size = preset.block_size
        if c.min_lr is None:
            c.min_lr = c.lr / 10
        if c.lr_warmup_steps is None:
            c.lr_warmup_steps = c.resolved_lr_warmup_steps()
        if c.method in DILOCO_METHODS and c.diloco_inner_steps is None:
            c.diloco_inner_steps = c.resolved_inner_steps()  # (kept: a resume with new --steps keeps H)
        if c.eval_every is None:
            c.eval_every = max(1, c.steps // 6)
        if c.checkpoint_every is None:
            c.checkpoint_every = max(1, c.steps // 3)
        c.edgc = dataclasses.asdict(c.edgc_config())
        c.dac = c.dac_config().to_dict()
        if c.expert_edgc:  # (every field written out, as `edgc`; a run that sets none keeps {}: the run's)
            c.expert_edgc = dataclasses.asdict(c.expert_edgc_config())
        if c.pp > 1 and c.microbatches is None:
            c.microbatches = 2 * c.pp
        return c

    def resolved_lr_warmup_steps(self) -> int:
        """The learning rate's warm-up in steps: as given, else a twentieth of the run."""
        return self.lr_warmup_steps if self.lr_warmup_steps is not None else max(1, self.steps // 20)

    def edgc_config(self) -> EDGCConfig:
        """The EDGCConfig for this run: overrides from `edgc`, the rest scaled to `steps`.

        The paper's window of 1000 iterations and alpha = 0.1 fit runs of 10^5 steps. For
        a run of S steps: window = S // 15 (at least 5) so the rank can move ~15 times;
        alpha gives at least 5 entropy samples per window; the warm-up lasts at most 10% of
        the steps (release), ended by the gradient (EDGCConfig.warmup) but not before the
        learning rate's warm-up has ended (warmup_min_steps), fixed in a pipeline.
        """
        values: dict[str, Any] = {
            "policy": "static" if self.method == "powersgd" else EDGCConfig().policy,
            **({"long_rank_factor": 1.0} if self.method == "powersgd" else {}),  # (PowerSGD: one rank)
            "max_rank": self.rank,
            # (the rule EDGCConfig(total_steps=...) follows; an invalid window is left for
            # EDGCConfig to reject by name)
            **run_scaled(self.sync_steps(), self.edgc.get("window")),
            "seed": self.seed,
            # a pipeline stage syncs after its backward pass and sends (edgc.comm.pipeline):
            # there is nothing to overlap, and whole steps keep its DAC timings whole
            "sync_mode": "whole-step" if self.pp > 1 else "pipelined",
            # each stage measures its own gradient, so a warm-up the gradient ends would end
            # at different steps in different stages: a pipeline keeps the fixed warm-up
            **({"warmup": "fixed"} if self.pp > 1 else {}),
        }
        values.update(self.edgc)
        if values.get("warmup", EDGCConfig().warmup) == "gradient" and "warmup_min_steps" not in self.edgc:
            # compression starts once the learning rate has stopped rising
            lr_warmup = self.resolved_lr_warmup_steps() // (self.resolved_inner_steps()
                                                             if self.method in DILOCO_METHODS else 1)
            most = values["warmup_steps"]
            values["warmup_min_steps"] = min(lr_warmup, most) if isinstance(most, int) and most >= 0 else 0
        return EDGCConfig.from_dict(values)

    def sync_steps(self) -> int:
        """The syncs of the run: its steps, or with DiLoCo its outer steps (steps // H, at
        least 1), which edgc-diloco's window and warm-up count."""
        return max(1, self.steps // self.resolved_inner_steps()) if self.method in DILOCO_METHODS else self.steps

    def expert_edgc_config(self) -> EDGCConfig:
        """The EDGCConfig of the experts' core: the run's (`edgc_config`) with the
        `expert_edgc` overrides; raises ValueError naming the field."""
        return expert_config(self.edgc_config(), self.expert_edgc)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """Build from a mapping (a config file, the CLI, a saved config.json); raises
        ValueError naming an unknown key or a value of the wrong type (validate() checks
        the rest), so that nothing downstream meets text where a number belongs."""
        reject_unknown_fields(cls, values, "unknown training option(s)")
        cfg = cls(**values)
        check_field_types(cfg, cfg._refuse)
        return cfg

    def _refuse(self, name: str, why: str) -> None:
        """Raise ValueError "<name>=<value>: <why>" about field `name`."""
        raise ValueError(f"{name}={getattr(self, name)!r}: {why}")
