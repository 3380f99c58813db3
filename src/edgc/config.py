"""Configuration for EDGC compression.

`EDGCConfig` holds what every policy shares, and one section per policy that has
parameters of its own (`noise`, `critical`, `cqm`, `schedule`), each declared with its
policy in edgc.policy. Every field is documented where it is declared. `validate()` runs
in `__post_init__`, so an invalid value raises `ValueError` naming the field before any
worker starts.

Three spellings build the same config:

    EDGCConfig(policy="noise", max_rank=32, noise=NoiseConfig(exponent=0.25))
    EDGCConfig.from_dict({"policy": "noise", "max_rank": 32, "noise": {"exponent": 0.25}})
    EDGCConfig.from_dict({"policy": "noise", "max_rank": 32, "noise_exponent": 0.25})

The last, flat, form is the command line's (`--edgc-noise-exponent 0.25`). A config saved
by edgc 0.1 (flat, with the warm-up in three fields) is read by `upgrade_config_v1`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from edgc.entropy import ESTIMATORS
from edgc.fields import check_field_types, reject_unknown_fields
from edgc.policy.cqm import CQMConfig
from edgc.policy.critical import CriticalConfig
from edgc.policy.noise import NoiseConfig
from edgc.policy.registry import REMOVED, policy_class, policy_names, policy_settings_class
from edgc.policy.schedule import ScheduleConfig, parse_rank_schedule
from edgc.policy.warmup import WARMUP_MODES

__all__ = ["ADDED_FIELDS", "MAX_RANK", "MAX_UNITS", "ORTHOGONALIZATIONS", "REMOVED_FIELDS", "SECTIONS", "SEED_LIMIT",
           "RUN_SCALED", "STATE_DTYPES", "SYNC_MODES", "WIRE_FORMATS", "EDGCConfig", "flat_sections",
           "pipeline_refusal", "run_scaled", "upgrade_config_v1", "with_added_fields"]

WARMUP_ERROR_NORMS = ("relative", "l1")
#: How the hook schedules a step's collectives (EDGCConfig.sync_mode).
SYNC_MODES = ("pipelined", "whole-step")
#: The formats the low-rank factors travel in (EDGCConfig.wire; edgc.comm.wire).
WIRE_FORMATS = ("native", "bf16", "int8", "int4", "fp8")
#: The formats the experts' all-to-all may travel in (edgc.moe.ExpertParallel, edgc train --ep-wire).
EP_WIRES = ("native", "int8")
#: The dtype the error feedback and Q are kept in between steps (EDGCConfig.state_dtype).
STATE_DTYPES = ("native", "float32", "bf16")
#: How P is orthonormalised in the round (EDGCConfig.orthogonalization; edgc.compress.orthogonalize_).
ORTHOGONALIZATIONS = ("cholesky", "householder")
#: The most units a step may be cut into (EDGCConfig.max_units).
MAX_UNITS = 1024

#: The largest rank any config takes (max_rank, min_rank, a run's rank): above every
#: matrix side of the presets (the widest: GPT-2's 50257-token embedding), and small
#: enough to catch a typo such as 10**9.
MAX_RANK = 2**16
#: The most histogram bins: torch.histc allocates them all on every sampled step.
MAX_BINS = 2**20
#: The smallest sampling rate taken (one sample per million steps or elements): below
#: it a rate is almost surely a typo, and 1/rate stops being a usable stride.
MIN_SAMPLE_RATE = 1e-6
#: The most timed all-reduces per probed rank when calibrating r_max.
MAX_CALIBRATION_REPEATS = 100
#: Seeds lie in [0, SEED_LIMIT): torch takes them as 64-bit integers, and the trainer
#: derives per-replica seeds from them (seed * 7919 + replica).
SEED_LIMIT = 2**32

#: The per-policy sections of EDGCConfig: field name -> its dataclass.
SECTIONS: dict[str, type] = {"noise": NoiseConfig, "critical": CriticalConfig, "cqm": CQMConfig,
                             "schedule": ScheduleConfig}


class _Unset(int):
    """A run-length default of EDGCConfig (an int that says it was not given): replaced in
    __post_init__ by its value scaled to `total_steps`, or by itself as a plain int."""


class _UnsetRate(float):
    """_Unset for a float field (iteration_sample_rate)."""


#: The EDGCConfig fields whose defaults depend on the run's length (`run_scaled`).
RUN_SCALED = ("window", "iteration_sample_rate", "warmup_steps")


def run_scaled(total_steps: int, window: Any = None) -> dict[str, Any]:
    """The run-length settings for a run of `total_steps` optimiser steps, one rule for
    EDGCConfig(total_steps=...) and `edgc train`: the window total_steps // 15 (at least
    5), so that the rank can move about 15 times; alpha 5 / window within [0.1, 1], at
    least 5 entropy samples a window; the warm-up at most a tenth of the run. `window`:
    one given instead (alpha follows it; a value that is no positive integer is kept for
    EDGCConfig to refuse by name)."""
    scaled: dict[str, Any] = {"window": max(5, total_steps // 15) if window is None else window,
                              "warmup_steps": max(1, total_steps // 10)}
    w = scaled["window"]
    good = isinstance(w, int) and not isinstance(w, bool) and w > 0
    scaled["iteration_sample_rate"] = min(1.0, max(0.1, 5 / w)) if good else 0.1
    return scaled


@dataclass(kw_only=True)
class EDGCConfig:
    """Hyperparameters of the EDGC compressor (docs/method.md explains each step)."""

    #: The values each text field may take (validate checks them; the CLI lists them).
    #: "policy" takes the names in the registry (edgc.policy.registry), checked apart.
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "entropy_estimator": ESTIMATORS, "warmup": WARMUP_MODES, "warmup_error_norm": WARMUP_ERROR_NORMS,
        "sync_mode": SYNC_MODES, "wire": WIRE_FORMATS, "state_dtype": STATE_DTYPES,
        "orthogonalization": ORTHOGONALIZATIONS,
    }

    total_steps: int | None = None
    """The run's length in optimiser steps. Given, the defaults that suit a run of about
    10^5 steps (the paper's) are scaled to it, as `edgc train` scales them (`run_scaled`):
    `window`, `iteration_sample_rate` and `warmup_steps`, each unless given. None: those
    keep their defaults, and the first compressed step warns once that they assume a long
    run."""

    policy: str = "noise"
    """How the rank is chosen, by name in the policy registry: "noise" (the default: r_max
    while the averaged gradient is mostly signal, falling as the gradient noise scale
    grows), "cqm" (the paper's rule, r1 = g^-1(e^(H0-H1) g(r0)) from the gradient's
    entropy), "linear" (the released code's rule), "static" (the fixed rank `max_rank`:
    PowerSGD), "schedule" (a fixed step function of the step, `schedule.ranks`) or
    "critical" (experimental, after Accordion). docs/policies.md says how to choose."""

    max_rank: int | None = None
    """Upper rank bound r_max, at most MAX_RANK (65536). None: calibrate it by timing
    compressed against uncompressed all-reduce at ranks 2, 4, 8, ... during warm-up
    (release behaviour)."""

    min_rank: int | None = None
    """Lower rank bound r_min, at most max_rank. None: max_rank // 4 (the paper recommends
    r_max/4 to r_max/6)."""

    rank_step: int = 4
    """s: the most the rank may move in one window, the first move included (release: 4).
    In [1, MAX_RANK]."""

    rank_multiple: int = 2
    """Ranks are rounded to a multiple of this (release: even ranks). In [1, MAX_RANK]."""

    long_rank_factor: float = 2.0
    """A long matrix, whose longer side is at least 5 times its shorter (in a GPT-2: the
    token embedding, vocabulary x width, shared with the output layer), compresses at this
    times the policy's rank, rounded down to rank_multiple; every other matrix at the
    policy's rank; each capped by its matrix (edgc.compress.matrix_rank). At rank r a long
    matrix sends r / min(m, n) of its numbers, half the share a square matrix of its width
    sends, and it is where low rank costs the loss most (docs/method.md). 1: one rank for
    every matrix, as PowerSGD. A finite number in (0, 16]."""

    window: int = _Unset(1000)  # (an _Unset default: scaled to total_steps when that is given)
    """w: iterations per window; the rank is revisited once per window (paper: 1000).
    Unless given, total_steps // 15 (at least 5) when `total_steps` is."""

    iteration_sample_rate: float = _UnsetRate(0.1)
    """alpha: the gradient is sampled every round(1/alpha) iterations (paper: 0.1). In
    [MIN_SAMPLE_RATE, 1] = [1e-6, 1]. Unless given, 5 / window (within [0.1, 1]) when
    `total_steps` is: at least 5 samples a window."""

    gradient_sample_rate: float = 0.25
    """beta: the fraction of gradient elements sampled; every round(1/beta)-th element of
    the flat gradient (paper and release: 0.25). In [MIN_SAMPLE_RATE, 1] = [1e-6, 1]."""

    entropy_estimator: str = "histogram"
    """"histogram" (Shannon entropy over a histogram, as released) or "gaussian"
    (1/2 log(2 pi e sigma^2))."""

    differential: bool = True
    """For the histogram estimator: add log(bin width), giving the differential entropy,
    which shifts by log c when the gradient scales by c (the CQM relies on this). False
    gives the release's discrete entropy, which does not move with scale."""

    bins: int = 1000
    """Histogram bins (release: 1000), at most MAX_BINS (2**20)."""

    warmup: str = "gradient"
    """How the warm-up (steps sent whole before compression starts) ends: "gradient" (at
    the first check, every round(1/iteration_sample_rate) steps, where the best
    rank-r_max approximation of the replica-averaged gradient leaves out at most
    `warmup_max_error` of its norm; after `warmup_steps` at the latest), "fixed" (after
    exactly `warmup_steps`) or "release-check" (the released code's criterion: after at
    least `warmup_steps`, at the first window end where the error at r_min, in
    `warmup_error_norm`, falls below the error at r_max recorded at the first check)."""

    warmup_steps: int = _Unset(1000)
    """The warm-up's length in steps: the most ("gradient"), exactly ("fixed") or the
    least ("release-check"); 0 or more (torch's PowerSGD hook defaults to 1000). Unless
    given, total_steps // 10 (at least 1) when `total_steps` is."""

    warmup_min_steps: int = 0
    """For warmup "gradient": the fewest steps sent whole. Compression starts after the
    first check that passes or after this step, whichever is later; at most
    `warmup_steps`. Set it to the learning rate's warm-up, as `edgc train` does:
    compressing while the rate still rises costs loss that later steps do not win back."""

    warmup_max_error: float = 0.1
    """For warmup "gradient": the share of the gradient's norm that compressing at r_max
    may leave out for the warm-up to end. In (0, 1]."""

    warmup_error_norm: str = "relative"
    """For warmup "release-check": the error compared, "relative" (the Frobenius error of
    the best rank-r approximation over the gradient's norm) or "l1" (its mean absolute
    error per element, in gradient units, as the release measures it)."""

    calibration_repeats: int = 3
    """Timed compressed all-reduces per probed rank when calibrating r_max (release: ~3),
    at most MAX_CALIBRATION_REPEATS (100)."""

    min_compression_rate: float = 2.0
    """A matrix is compressed only if m*n / ((m+n)*r_max) is at least this; others, and
    every tensor with fewer than 2 dimensions, are all-reduced uncompressed. A finite
    number >= 0."""

    use_error_feedback: bool = True
    """Carry the compression error into the next step's gradient (PowerSGD/EF-SGD)."""

    warm_start: bool = True
    """Reuse Q from the previous step instead of drawing a new random Q (release: on)."""

    seed: int = 0
    """Seed of the replica-identical generator that draws Q columns, in [0, 2**32)."""

    sync_mode: str = "pipelined"
    """When the hook communicates (edgc.comm.step): "pipelined" starts each DDP bucket's
    all-reduce as soon as DDP hands the bucket over and finishes the bucket before it
    meanwhile (a fixed lag of one bucket, so that every replica issues the same
    collectives in the same order), overlapping the sync with the backward pass;
    "whole-step" waits for the last bucket and synchronises the whole gradient at once:
    no overlap, but the fewest collectives (the default of pipeline stages, whose sync
    runs after their backward pass anyway). Both give the same average up to float
    reassociation."""

    min_unit_mb: float = 0.0
    """For sync_mode "pipelined": the least bytes, in MB (1e6 bytes), that one unit of the
    sync puts on the wire in a step. Consecutive DDP buckets are merged into one unit until
    it reaches this (edgc.comm.step, "Coarse units"): fewer, larger collectives against
    less overlap. 0 (the default): no least size (max_units still merges buckets; both 0
    make every bucket a unit). Changes the average only through
    the float order of the sums, so a resumed run may change it. A finite number >= 0;
    "whole-step" ignores it."""

    max_units: int = 4
    """For sync_mode "pipelined": the most units a step is cut into. Consecutive DDP
    buckets are merged, in order, into units that each hold at least 1/max_units of the
    step's bytes on the wire (edgc.comm.step, "Coarse units"), so that the round launches
    a few batched ops per matrix shape and unit, not per bucket: DDP's 25 MB buckets hold
    less than one layer of a large model. Fewer units, fewer launches; more, more of the
    sync overlapped with the backward pass. 0: no cap (every bucket a unit, or as
    min_unit_mb merges them). Changes the average only through the float order of the
    sums and of the batched arithmetic, so a resumed run may change it. An integer in
    [0, 1024]; "whole-step" ignores it."""

    orthogonalization: str = "cholesky"
    """How P is orthonormalised (edgc.compress.orthogonalize_): "cholesky" (the default),
    shifted Cholesky-QR2 in float64, a dozen batched ops per shape whatever the batch and
    no host synchronisation; "householder", Householder QR (Gram-Schmidt at rank <= 2),
    which on a GPU launches a solver call per matrix once they have more than a few hundred
    rows. Both span the same columns; docs/method.md gives the bounds."""

    wire: str = "int8"
    """The format what a step sums travels in (edgc.comm.wire): the factors P and Q and
    the tensors sent whole. "int8" (the default) or "fp8": one byte an element, with a
    bfloat16 scale per block of 32, summed by a reduce-scatter and an all-gather; "int4":
    the same with two 4-bit codes a byte (edgc-diloco's, which keeps error feedback for
    the tensors sent whole too); "bf16"; "native" (the gradient's own dtype, as torch's
    PowerSGD hook sends). The error feedback keeps what the factors' rounding loses.
    docs/config.md says why int8."""

    state_dtype: str = "native"
    """The dtype the error feedback and the warm-start Q are kept in between steps.
    "native": the error feedback in the gradient's own dtype (bf16 for fp16 gradients,
    whose range a residual kept unscaled can leave), as torch's PowerSGD hook keeps it, and
    Q in the working dtype (float32 for half-precision gradients). "float32": both in the
    working dtype (twice the memory for bf16 gradients; the same for float32 ones).
    "bf16": both in bf16 (half the memory for float32 gradients). The arithmetic runs in
    the working dtype whatever is kept. docs/costs.md gives the bytes and the loss each costs."""

    noise: NoiseConfig = field(default_factory=NoiseConfig)
    """The "noise" policy's parameters (edgc.policy.noise)."""

    critical: CriticalConfig = field(default_factory=CriticalConfig)
    """The "critical" policy's parameters (edgc.policy.critical)."""

    cqm: CQMConfig = field(default_factory=CQMConfig)
    """The "cqm" policy's parameters (edgc.policy.cqm)."""

    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """The "schedule" policy's parameters (edgc.policy.schedule)."""

    policy_settings: dict[str, Any] = field(default_factory=dict)
    """The settings of a policy registered from your own code with a settings dataclass
    (edgc.policy.registry.register_policy(name, factory, settings=...)): a table of its
    fields, or an instance; the policy reads them as that dataclass (`settings()`). Empty
    for the built-in policies, whose settings are the sections above."""

    def __post_init__(self) -> None:
        self._scale_to_run()
        if dataclasses.is_dataclass(self.policy_settings) and not isinstance(self.policy_settings, type):
            self.policy_settings = dataclasses.asdict(self.policy_settings)  # (kept as its table)
        for name, cls in SECTIONS.items():  # (a table of a section's options builds the section)
            value = getattr(self, name)
            if isinstance(value, dict):
                reject_unknown_fields(cls, value, f"EDGCConfig.{name} has no field(s)")
                setattr(self, name, cls(**value))
        self.validate()

    def _scale_to_run(self) -> None:
        """Give each field left at its run-length default (an _Unset value) its value:
        scaled to `total_steps` when that is a valid length, else the default itself."""
        steps = self.total_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            self._bad("total_steps", "must be a positive integer (the run's optimiser steps) or None")
        window = None if isinstance(self.window, _Unset) else self.window
        scaled = run_scaled(steps, window) if steps is not None else {}
        #: the run-length fields left at the defaults of a long run (no total_steps given)
        self.long_run_defaults = tuple(n for n in RUN_SCALED if steps is None
                                       and isinstance(getattr(self, n), (_Unset, _UnsetRate)))
        for name in RUN_SCALED:
            value = getattr(self, name)
            if isinstance(value, _Unset):
                setattr(self, name, scaled.get(name, int(value)))
            elif isinstance(value, _UnsetRate):
                setattr(self, name, scaled.get(name, float(value)))

    def _bad(self, path: str, why: str) -> None:
        """Raise ValueError "EDGCConfig.<path>=<value>: <why>" (path: "field" or "section.field")."""
        value: Any = self
        for part in path.split("."):
            value = getattr(value, part)
        raise ValueError(f"EDGCConfig.{path}={value!r}: {why}")

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field and saying what it may be: its
        type first (no bool for an int, no NaN or infinity for a number), then its range."""
        bad = self._bad
        if self.warmup_max_error is None:  # (edgc 0.1's spelling of a fixed warm-up)
            bad("warmup_max_error", 'must be a number in (0, 1]; for a fixed warm-up set warmup="fixed"')
        check_field_types(self, bad)
        self._check_ranks(bad)
        self._check_sections(bad)
        self._check_policy_settings(bad)
        self._check_counts(bad)
        self._check_warmup(bad)
        self._check_numbers(bad)

    def _check_ranks(self, bad: Callable[[str, str], None]) -> None:
        """The policy's name and the rank bounds."""
        if self.policy not in policy_names():
            bad("policy", REMOVED.get(self.policy, f"must be one of {policy_names()}"))
        if self.max_rank is not None and not 1 <= self.max_rank <= MAX_RANK:
            bad("max_rank", f"must be an integer in [1, {MAX_RANK}] or None (calibrate)")
        if self.min_rank is not None and not 1 <= self.min_rank <= MAX_RANK:
            bad("min_rank", f"must be an integer in [1, {MAX_RANK}] or None (max_rank // 4)")
        if self.min_rank is not None and self.max_rank is not None and self.min_rank > self.max_rank:
            bad("min_rank", f"must not exceed max_rank={self.max_rank}")
        if self.policy in ("static", "schedule") and self.max_rank is None:
            bad("max_rank", f'the "{self.policy}" policy needs a fixed rank')

    def _check_sections(self, bad: Callable[[str, str], None]) -> None:
        """Each policy's section, and what it must agree on with the rank bounds."""
        for name in SECTIONS:
            getattr(self, name).check(lambda sub, why, _n=name: bad(f"{_n}.{sub}", why))
        if self.policy == "schedule" and not self.schedule.ranks:
            bad("schedule.ranks", 'the "schedule" policy needs at least one knot "STEP:RANK"')
        if self.schedule.ranks and self.max_rank is not None:
            if max(r for _, r in parse_rank_schedule(self.schedule.ranks)) > self.max_rank:
                bad("schedule.ranks", f"ranks must not exceed max_rank={self.max_rank}")
        low = self.critical.low_rank
        if low is not None and self.max_rank is not None:
            if low > self.max_rank:
                bad("critical.low_rank", f"must not exceed max_rank={self.max_rank}")
            floor = self.resolved_min_rank(self.max_rank)
            if low < floor:
                why = f"min_rank={floor}" if self.min_rank is not None else f"min_rank (max_rank // 4 = {floor})"
                bad("critical.low_rank", f"must not be below {why}; lower min_rank too")

    def _check_policy_settings(self, bad: Callable[[str, str], None]) -> None:
        """A registered policy's own settings (policy_settings): its dataclass's fields,
        their types and its `check`."""
        cls = policy_settings_class(self.policy)
        if cls is None:
            if self.policy_settings:
                bad("policy_settings", f"policy {self.policy!r} takes no settings here (a built-in policy's are in "
                                       "its section; a registered one's need register_policy(..., settings=...))")
            return
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(self.policy_settings) - known):
            bad("policy_settings", f"{cls.__name__} has no field(s) {unknown}; known: {sorted(known)}")
        try:
            settings = cls(**self.policy_settings)
        except TypeError as exc:  # (a field without a default left out)
            bad("policy_settings", f"{cls.__name__}: {exc}")

        def bad_setting(name: str, why: str) -> None:
            raise ValueError(f"EDGCConfig.policy_settings.{name}={getattr(settings, name)!r}: {why}")

        check_field_types(settings, bad_setting)
        if callable(getattr(settings, "check", None)):
            settings.check(bad_setting)

    def settings(self) -> Any:
        """The policy's own settings as the dataclass registered with it, built from
        `policy_settings`; None for a policy registered without one."""
        cls = policy_settings_class(self.policy)
        return None if cls is None else cls(**self.policy_settings)

    def _check_counts(self, bad: Callable[[str, str], None]) -> None:
        """Integer settings with a range, and the sampling rates."""
        for name, most in (("rank_step", MAX_RANK), ("rank_multiple", MAX_RANK), ("bins", MAX_BINS),
                           ("calibration_repeats", MAX_CALIBRATION_REPEATS)):
            if not 1 <= getattr(self, name) <= most:
                bad(name, f"must be an integer in [1, {most}]")
        if self.window < 1:
            bad("window", "must be a positive integer")
        if not 0 <= self.max_units <= MAX_UNITS:
            bad("max_units", f"must be an integer in [0, {MAX_UNITS}] (0: no cap)")
        for name in ("iteration_sample_rate", "gradient_sample_rate"):
            if not MIN_SAMPLE_RATE <= getattr(self, name) <= 1.0:
                bad(name, f"must be in [{MIN_SAMPLE_RATE:g}, 1]")

    def _check_warmup(self, bad: Callable[[str, str], None]) -> None:
        """The warm-up's settings, each read by its own kind of warm-up only."""
        if self.warmup_steps < 0:
            bad("warmup_steps", "must be a non-negative integer")
        if self.warmup_min_steps < 0:
            bad("warmup_min_steps", "must be a non-negative integer")
        if self.warmup_min_steps > self.warmup_steps:
            bad("warmup_min_steps", f"must be at most warmup_steps ({self.warmup_steps})")
        if self.warmup_min_steps != 0 and self.warmup != "gradient":
            bad("warmup_min_steps", f'is read by warmup="gradient" only (warmup={self.warmup!r}: warmup_steps sets '
                "the length)")
        if not 0.0 < self.warmup_max_error <= 1.0:
            bad("warmup_max_error", "must be in (0, 1]")
        if self.warmup_max_error != _DEFAULT_MAX_ERROR and self.warmup != "gradient":
            bad("warmup_max_error", f'is read by warmup="gradient" only (warmup={self.warmup!r} does not end on an '
                                    'error)')
        if self.warmup_error_norm != "relative" and self.warmup != "release-check":
            bad("warmup_error_norm", f'is read by warmup="release-check" only (warmup={self.warmup!r} measures '
                                     'the relative error)')

    def _check_numbers(self, bad: Callable[[str, str], None]) -> None:
        """The remaining numbers, the wire format's availability and the seed."""
        if self.min_compression_rate < 0:
            bad("min_compression_rate", "must be a non-negative number")
        if not 0 < self.long_rank_factor <= 16:
            bad("long_rank_factor", "must be a number in (0, 16] (1: one rank for every matrix)")
        if self.min_unit_mb < 0:
            bad("min_unit_mb", "must be a non-negative number (MB)")
        if self.wire == "fp8" and not hasattr(torch, "float8_e4m3fn"):
            bad("wire", f"needs torch.float8_e4m3fn, which torch {torch.__version__} lacks; use \"int8\"")
        if not 0 <= self.seed < SEED_LIMIT:
            bad("seed", "must be an integer in [0, 2**32)")

    def resolved_min_rank(self, max_rank: int) -> int:
        """r_min for a known r_max: the configured value, or max_rank // 4 (at least 1)."""
        if self.min_rank is not None:
            return min(self.min_rank, max_rank)
        return max(1, max_rank // 4)

    def to_dict(self) -> dict[str, Any]:
        """The config as a nested mapping: each section a table of its options."""
        return dataclasses.asdict(self)

    def to_flat(self) -> dict[str, Any]:
        """The config as a flat mapping, each section's options as "<section>_<option>"
        ("noise_exponent"), as the command line names them."""
        out = self.to_dict()
        for name in SECTIONS:
            out.update({f"{name}_{k}": v for k, v in out.pop(name).items()})
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EDGCConfig:
        """Build from a mapping, nested (`to_dict`) or flat (`to_flat`), or both (a flat key
        wins over its section's table); an unknown key raises ValueError naming it."""
        return cls(**nest(values))


#: The default of EDGCConfig.warmup_max_error, which other warm-up modes leave as it is.
_DEFAULT_MAX_ERROR = EDGCConfig.__dataclass_fields__["warmup_max_error"].default


def flat_sections(values: dict[str, Any]) -> dict[str, Any]:
    """EDGCConfig options with each section's table ({"noise": {"exponent": 0.2}}) as flat
    keys ("noise_exponent"), as the command line names them (`nest` undoes it)."""
    out = {k: v for k, v in values.items() if not (k in SECTIONS and isinstance(v, dict))}
    for name in SECTIONS:
        if isinstance(values.get(name), dict):
            out.update({f"{name}_{k}": v for k, v in values[name].items()})
    return out


def nest(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with every flat section key ("noise_exponent") moved into its section's
    table ({"noise": {"exponent": ...}}); raises ValueError naming an unknown key."""
    out = dict(values)
    tables: dict[str, Any] = {}
    for name in SECTIONS:
        if name in out:
            given = out.pop(name)
            is_section = dataclasses.is_dataclass(given) and not isinstance(given, type)
            tables[name] = dataclasses.asdict(given) if is_section else given
    for key in list(out):
        section, _, option = key.partition("_")
        if section in SECTIONS and option in {f.name for f in dataclasses.fields(SECTIONS[section])}:
            table = tables.setdefault(section, {})
            if not isinstance(table, dict):
                raise ValueError(f"EDGCConfig.{section} must be a table of options, got {table!r}")
            table[option] = out.pop(key)
    reject_unknown_fields(EDGCConfig, out, "EDGCConfig has no field(s)")
    return {**out, **tables}


#: Fields EDGCConfig gained after its saved form (a state's "config", a run's config.json)
#: was first written, each with the value a config saved before it ran with: there a
#: missing key means that value, not today's default (`with_added_fields`).
ADDED_FIELDS: dict[str, Any] = {"long_rank_factor": 1.0, "max_units": 0, "orthogonalization": "householder"}


#: Fields removed since they were saved, with the value that behaves as today: a saved
#: config holding that value loads without it; any other value cannot resume.
REMOVED_FIELDS: dict[str, tuple[Any, str]] = {
    "alternate": (False, "the alternating mode (one factor a step) was removed in edgc 0.2.0: it ended 0.117 nats "
                         "behind static rank 32 (BENCHMARKS.md)"),
}


def with_added_fields(values: dict[str, Any]) -> dict[str, Any]:
    """A saved EDGCConfig mapping (nested or flat) with each field it predates
    (ADDED_FIELDS) set to the value it ran with, and each field since removed
    (REMOVED_FIELDS) left out; raises ValueError when a removed field was on."""
    out = {**ADDED_FIELDS, **values}
    for name, (inert, why) in REMOVED_FIELDS.items():
        if name in out and out.pop(name) != inert:
            raise ValueError(f"this state or run was saved with {name}={values[name]!r}, which cannot resume: {why}")
    return out


#: What a config saved by edgc 0.1 ran with where it lacks a key: fields added during
#: 0.1 had no effect before they existed ("whole-step" was the only sync mode, and the
#: warm-up was fixed). 0.1 sent P and Q in the gradient's dtype ("native" wire) and kept
#: the error feedback and Q in the working dtype, float32 for half-precision gradients
#: (its saved groups hold them so): "float32", not today's default "native", whose error
#: feedback of bf16 or fp16 gradients is bf16.
_V1_DEFAULTS: dict[str, Any] = {"sync_mode": "whole-step", "warmup_max_error": None, "warmup_error_check": False,
                                "wire": "native", "state_dtype": "float32",
                                "noise_exponent": 0.5, **ADDED_FIELDS}
#: edgc 0.1's flat names whose 0.2 name differs (the rest keep theirs: noise_exponent, ...).
_V1_RENAMED = {"lr_drop_factor": "critical_lr_drop_factor", "entropy_smoothing": "cqm_smoothing",
               "rank_schedule": "schedule_ranks"}
#: edgc 0.1 fields of the policies since removed.
_V1_REMOVED = ("error_budget", "spectral_headroom")


def upgrade_config_v1(values: dict[str, Any]) -> dict[str, Any]:
    """An EDGCConfig mapping saved by edgc 0.1 (flat; the warm-up as `warmup_error_check`
    and a `warmup_max_error` that None made fixed) as the nested mapping of today's
    EDGCConfig, with the same behaviour: the fields 0.1 lacked as it ran (wire "native",
    state_dtype "float32", ...). Raises ValueError for a removed policy."""
    old = {**_V1_DEFAULTS, **values}
    if old.get("policy") in REMOVED:
        raise ValueError(f"this state or run uses policy {old['policy']!r}, {REMOVED[old['policy']]}")
    check, max_error = bool(old.pop("warmup_error_check")), old.pop("warmup_max_error")
    old["warmup"] = "release-check" if check else ("fixed" if max_error is None else "gradient")
    if max_error is not None:
        old["warmup_max_error"] = max_error
    for name in _V1_REMOVED:
        old.pop(name, None)
    for before, after in _V1_RENAMED.items():
        if before in old:
            old[after] = old.pop(before)
    return EDGCConfig.from_dict(old).to_dict()


def pipeline_refusal(config: EDGCConfig) -> str | None:
    """Why `config` cannot run on a pipeline's stages (under the DAC's stage alignment), or
    None: one answer for `edgc train --pp` and for a GradientSync given an alignment."""
    if not getattr(policy_class(config.policy), "aligns", True):
        return (f"EDGCConfig.policy={config.policy!r}: does not take the DAC's stage alignment yet; use one of "
                f"{tuple(n for n in policy_names() if getattr(policy_class(n), 'aligns', True))} in a pipeline")
    if config.warmup == "gradient":
        # (each stage measures its own gradient, so the stages would end their warm-ups at
        # different steps, and the DAC's window-end exchange needs every stage compressing)
        return ('EDGCConfig.warmup="gradient": a pipeline\'s stages would end the warm-up at different steps; use '
                '"fixed" (the default of edgc train with pp > 1)')
    return None
