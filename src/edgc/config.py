"""Configuration for EDGC compression.

Every field is documented where it is declared. `EDGCConfig.validate()` runs in
`__post_init__`, so an invalid value raises `ValueError` naming the field before
any worker starts.

The shared rules every config here follows live at the bottom: `field_types` reads each
field's type from its annotation, `check_field_types` refuses a value of another type (a
bool where an int belongs, NaN or infinity where a number belongs), and
`FieldType.parse` reads a field's value from command-line text by the same rules.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import math
import re
import textwrap
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from edgc.entropy import ESTIMATORS
from edgc.policy.cqm import METHODS as CQM_METHODS
from edgc.policy.schedule import parse_rank_schedule

POLICIES = ("cqm", "linear", "static", "budget", "spectral", "schedule", "critical", "noise")
#: Policies that set one rank per group of same-shape matrices.
GROUP_POLICIES = ("budget", "spectral")
WARMUP_ERROR_NORMS = ("relative", "l1")
#: How the hook schedules a step's collectives (EDGCConfig.sync_mode).
SYNC_MODES = ("pipelined", "whole-step")

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


@dataclass(kw_only=True)
class EDGCConfig:
    """Hyperparameters of the EDGC compressor (see EDGC_SPEC.md)."""

    #: The values each text field may take (validate checks them; the CLI lists them).
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "policy": POLICIES, "entropy_estimator": ESTIMATORS, "cqm_method": CQM_METHODS,
        "warmup_error_norm": WARMUP_ERROR_NORMS, "sync_mode": SYNC_MODES,
    }
    #: Placeholders for values that are not plain text (the CLI's help shows them).
    METAVARS: ClassVar[dict[str, str]] = {"rank_schedule": "STEP:RANK,..."}

    policy: str = "noise"
    """How the rank is chosen: "noise" (the default, beyond the paper: see the end of this
    note), "cqm" (the paper's rule, r1 = g^-1(e^(H0-H1) g(r0))),
    "linear" (the released code's rule), "static" (fixed rank `max_rank`: PowerSGD), or
    "budget" (beyond the paper: one rank per group of same-shape matrices, steered each
    window towards leaving out `error_budget` of the group's energy; edgc.policy.budget), or
    "spectral" (beyond the paper: one rank per group, following the effective rank of the
    spectrum PowerSGD transmits; edgc.policy.spectral), or "schedule" (the rank as a fixed
    step function of the step, `rank_schedule`; edgc.policy.schedule), or "critical"
    (beyond the paper, after Accordion: r_max while the norm of the window's averaged
    gradient changes by at least `critical_threshold` from one window to the next, and
    for the window after a learning-rate drop, else `critical_low_rank`;
    edgc.policy.critical), or "noise" (beyond the paper: r_max while the averaged
    gradient's signal outweighs its noise, and r_max (n/B)^`noise_exponent` once the
    window's gradient noise scale B exceeds the n replicas' batch; edgc.policy.noise).
    "noise" is the default because, with the warm-up the gradient ends
    (`warmup_max_error`), it is the rule measured beyond the static PowerSGD frontier on
    both corpora (BENCHMARKS §13); "cqm" holds r_max on every workload measured (§8)."""

    max_rank: int | None = None
    """Upper rank bound r_max, at most MAX_RANK (65536). None: calibrate it by timing
    compressed against uncompressed all-reduce at ranks 2, 4, 8, ... during warm-up
    (release behaviour)."""

    min_rank: int | None = None
    """Lower rank bound r_min, at most max_rank. None: max_rank // 4 (the paper recommends
    r_max/4 to r_max/6)."""

    rank_step: int = 4
    """s: the most the rank may move in one window, the first move included (release: 4;
    its first move takes r_max - s when the mapped rank is further than s from r_max).
    In [1, MAX_RANK]."""

    rank_multiple: int = 2
    """Ranks are rounded to a multiple of this (release: even ranks). In [1, MAX_RANK]."""

    error_budget: float = 0.05
    """For policy "budget": the share of each matrix group's energy (gradient plus error
    feedback) that the low-rank approximation may leave out, averaged over a window."""

    spectral_headroom: float = 1.5
    """For policy "spectral": each group's rank is moved towards this multiple of its
    window-mean effective rank exp(H(σ²/Σσ²)); the rank settles where the transmitted
    spectrum's effective rank is 1/headroom of the rank (edgc.policy.spectral)."""

    rank_schedule: str = ""
    """For policy "schedule": knots "STEP:RANK,..." (e.g. "0:32,300:16"); from each
    knot's step on, compressed steps use its rank. Ranks must not exceed `max_rank`.
    Checked whatever the policy, so that a malformed schedule never passes unnoticed."""

    critical_threshold: float = 0.5
    """For policy "critical": eta, the relative change rho = |N_old - N_new| / N_old of
    the window gradient's norm from one window to the next at and above which the next
    window runs at r_max ("critical regime"; Accordion, Agarwal et al. 2021: 0.5). A
    finite number > 0; a large one keeps the low rank but after learning-rate drops."""

    critical_low_rank: int | None = None
    """For policy "critical": r_lo, the rank outside the critical regime, rounded to
    `rank_multiple` and kept in [r_min, r_max]. None: max_rank // 2 (at least 1), the low
    rank of the fixed schedule "0:32,500:16" that measured best against the static
    frontier (BENCHMARKS §9); r_min = max_rank // 4 may be lower than pays. The rank jumps
    between r_max and r_lo directly: `rank_step` does not apply. In [1, MAX_RANK], at most
    max_rank and at least min_rank (max_rank // 4 when unset) where they are given."""

    lr_drop_factor: float = 0.5
    """For policy "critical": a learning rate (EDGCState.set_learning_rate) falling in a
    window below this factor times the rate at the previous window end counts as a drop,
    and the next window runs at r_max (Accordion). In (0, 1). A smooth decay counts as
    a drop only where it halves the rate within one window (default factor)."""

    noise_exponent: float = 0.5
    """For policy "noise": gamma in r = r_max * min(1, (n / B)^gamma), B the window's
    gradient noise scale in replica batches and n the replicas (edgc.policy.noise). In
    (0, 4]; larger drops the rank faster as the noise grows."""

    window: int = 1000
    """w: iterations per entropy window; the rank is revisited once per window (paper: 1000)."""

    iteration_sample_rate: float = 0.1
    """alpha: entropy is estimated every round(1/alpha) iterations (paper: 0.1). In
    [MIN_SAMPLE_RATE, 1] = [1e-6, 1]."""

    gradient_sample_rate: float = 0.25
    """beta: the fraction of gradient elements used for the estimate; every
    round(1/beta)-th element of the flat gradient (paper and release: 0.25). In
    [MIN_SAMPLE_RATE, 1] = [1e-6, 1]."""

    entropy_estimator: str = "histogram"
    """"histogram" (Shannon entropy over a histogram, as released) or "gaussian"
    (1/2 log(2 pi e sigma^2))."""

    entropy_smoothing: float = 0.0
    """In [0, 1): the CQM compares exponential moving averages of the window mean
    entropies, each window weighing 1 - entropy_smoothing (0: the raw means, as the
    paper). A window mean of a few samples is noisy next to the entropy change the whole
    rank range spans, so smoothing keeps the rule from following noise."""

    differential: bool = True
    """For the histogram estimator: add log(bin width), giving the differential entropy,
    which shifts by log c when the gradient scales by c (the CQM relies on this). False
    gives the release's discrete entropy, which does not move with scale."""

    bins: int = 1000
    """Histogram bins (release: 1000), at most MAX_BINS (2**20)."""

    cqm_method: str = "mp"
    """How g(r; m, n) is computed for the CQM: "mp" (Marchenko-Pastur law) or
    "montecarlo" (exact SVD of sampled Gaussian matrices)."""

    warmup_steps: int = 1000
    """The uncompressed steps before compression starts (release: 10% of all iterations;
    torch's PowerSGD hook defaults to 1000); 0 or more. With `warmup_max_error` set (the
    default) this is the longest the warm-up may last; with it None, the exact length
    (the least, with `warmup_error_check`)."""

    warmup_error_check: bool = False
    """After `warmup_steps`, start compressing only at the first window end where the
    relative error of the best rank-r_min approximation is below eps_max, the error at
    r_max recorded when warm-up checks begin (release criterion, on in the release).
    Off by default: measured on the tiny GPT-2 (`edgc -v train --steps 200`), eps_max was
    0.078 at the first check (step 13) while eps(r_min) rose from 0.17 to 0.58 by step 195,
    so compression never started. Early gradients are the most low-rank ones here."""

    warmup_max_error: float | None = 0.1
    """An end of the warm-up decided by the gradient: when set (0.1 by default), the warm-up ends at the
    first check, every round(1/iteration_sample_rate) steps, where the relative error of
    the best rank-r_max approximation of the gradient (replica-averaged, in the
    `warmup_error_norm`, which must be "relative") is at most this: compressing at r_max
    then leaves out at most this share of the gradient's norm. `warmup_steps` becomes the
    longest the warm-up may last. None: the warm-up lasts `warmup_steps` (then the
    `warmup_error_check`, when on). In (0, 1]; None for `warmup_error_check` or the "l1"
    `warmup_error_norm`. Measured on the tiny GPT-2, 0.1 ends the warm-up at step 20 of
    1000, saves a sixth of static rank 32's bytes and costs its loss nothing beyond one
    standard error (BENCHMARKS §13)."""

    warmup_error_norm: str = "relative"
    """The error the warm-up check compares: "relative" (Frobenius error of the best
    rank-r approximation over the gradient's norm) or "l1" (its absolute mean |A - A_r|
    per element, in gradient units, as the release measures it). The absolute error
    falls as gradients shrink, so with "l1" the check can pass later in training."""

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
    """When the hook communicates (edgc.comm.stepsync): "pipelined" starts each DDP
    bucket's all-reduce as soon as DDP hands the bucket over and finishes the bucket
    before it meanwhile (a fixed lag of one bucket, so that every replica issues the same
    collectives in the same order), overlapping the sync with the backward pass;
    "whole-step" waits for the last bucket and synchronises the whole gradient at once:
    no overlap, but the fewest collectives (the default of pipeline stages, whose sync
    runs after their backward pass anyway). Both give the same average up to float
    reassociation."""

    min_unit_mb: float = 0.0
    """For sync_mode "pipelined": the least bytes, in MB (1e6 bytes), that one unit of the
    sync puts on the wire in a step. Consecutive DDP buckets are merged into one unit until
    it reaches this (edgc.comm.stepsync, "Coarse units"), counting (m + n) * r elements
    for a compressed matrix and every element for a tensor sent whole. Fewer, larger
    collectives against less overlap: a merged unit starts at its last bucket, so the
    buckets before it wait for it. Worth it at low rank, where a bucket's P and Q are small
    and each collective's latency, not its bytes, sets its time. 0 (the default): every
    bucket is a unit; a threshold above the whole step's bytes makes the step one unit,
    started at the last bucket. Changes the average only through the float order of the
    sums, so a resumed run may change it. A finite number >= 0; "whole-step" ignores it."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field and saying what it may be: its
        type first (no bool for an int, no NaN or infinity for a number), then its range."""
        def bad(field: str, why: str) -> None:
            raise ValueError(f"EDGCConfig.{field}={getattr(self, field)!r}: {why}")

        check_field_types(self, bad)
        if self.max_rank is not None and not 1 <= self.max_rank <= MAX_RANK:
            bad("max_rank", f"must be an integer in [1, {MAX_RANK}] or None (calibrate)")
        if self.min_rank is not None and not 1 <= self.min_rank <= MAX_RANK:
            bad("min_rank", f"must be an integer in [1, {MAX_RANK}] or None (max_rank // 4)")
        if self.min_rank is not None and self.max_rank is not None and self.min_rank > self.max_rank:
            bad("min_rank", f"must not exceed max_rank={self.max_rank}")
        if self.policy in ("static", "schedule") and self.max_rank is None:
            bad("max_rank", f'the "{self.policy}" policy needs a fixed rank')
        if self.policy == "schedule" or self.rank_schedule:
            try:
                knots = parse_rank_schedule(self.rank_schedule)
            except ValueError as exc:
                bad("rank_schedule", str(exc))
            if self.max_rank is not None and max(r for _, r in knots) > self.max_rank:
                bad("rank_schedule", f"ranks must not exceed max_rank={self.max_rank}")
        if not self.critical_threshold > 0:
            bad("critical_threshold", "must be a finite number > 0")
        if self.critical_low_rank is not None:
            if not 1 <= self.critical_low_rank <= MAX_RANK:
                bad("critical_low_rank", f"must be an integer in [1, {MAX_RANK}] or None (max_rank // 2)")
            if self.max_rank is not None and self.critical_low_rank > self.max_rank:
                bad("critical_low_rank", f"must not exceed max_rank={self.max_rank}")
            if self.max_rank is not None and self.critical_low_rank < self.resolved_min_rank(self.max_rank):
                floor = self.resolved_min_rank(self.max_rank)
                why = f"min_rank={floor}" if self.min_rank is not None else f"min_rank (max_rank // 4 = {floor})"
                bad("critical_low_rank", f"must not be below {why}; lower min_rank too")
        if not 0.0 < self.lr_drop_factor < 1.0:
            bad("lr_drop_factor", "must be in (0, 1)")
        if not 0.0 < self.noise_exponent <= 4.0:
            bad("noise_exponent", "must be in (0, 4]")
        for name, most in (("rank_step", MAX_RANK), ("rank_multiple", MAX_RANK), ("bins", MAX_BINS),
                           ("calibration_repeats", MAX_CALIBRATION_REPEATS)):
            if not 1 <= getattr(self, name) <= most:
                bad(name, f"must be an integer in [1, {most}]")
        if self.window < 1:
            bad("window", "must be a positive integer")
        for name in ("iteration_sample_rate", "gradient_sample_rate"):
            if not MIN_SAMPLE_RATE <= getattr(self, name) <= 1.0:
                bad(name, f"must be in [{MIN_SAMPLE_RATE:g}, 1]")
        if not 0.0 <= self.entropy_smoothing < 1.0:
            bad("entropy_smoothing", "must be in [0, 1)")
        if not 0.0 < self.error_budget < 1.0:
            bad("error_budget", "must be in (0, 1)")
        if not 1.0 <= self.spectral_headroom <= 8.0:
            bad("spectral_headroom", "must be in [1, 8]")
        if self.warmup_steps < 0:
            bad("warmup_steps", "must be a non-negative integer")
        if self.warmup_max_error is not None:
            if not 0.0 < self.warmup_max_error <= 1.0:
                bad("warmup_max_error", "must be in (0, 1] or None (a fixed warm-up)")
            if self.warmup_error_check:
                bad("warmup_max_error", "ends the warm-up by itself: set it to None (a fixed warm-up) to use "
                                        "warmup_error_check")
            if self.warmup_error_norm != "relative":
                bad("warmup_max_error", 'is a relative error: set it to None (a fixed warm-up) to use '
                                        'warmup_error_norm="l1"')
        if self.min_compression_rate < 0:
            bad("min_compression_rate", "must be a non-negative number")
        if self.min_unit_mb < 0:
            bad("min_unit_mb", "must be a non-negative number (MB)")
        if not 0 <= self.seed < SEED_LIMIT:
            bad("seed", "must be an integer in [0, 2**32)")

    def resolved_min_rank(self, max_rank: int) -> int:
        """r_min for a known r_max: the configured value, or max_rank // 4 (at least 1)."""
        if self.min_rank is not None:
            return min(self.min_rank, max_rank)
        return max(1, max_rank // 4)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EDGCConfig:
        """Build from a mapping; an unknown key raises ValueError naming it."""
        reject_unknown_fields(cls, values, "EDGCConfig has no field(s)")
        return cls(**values)


#: What a state or run saved before a field existed ran with, for the fields that came
#: after the first version: "whole-step" was the only sync mode, no saved run used the
#: "critical" or "noise" fields, and the warm-up was fixed (`warmup_max_error` None: its
#: default today is 0.1). Filled in for the missing keys of an older save.
EARLIER_DEFAULTS: dict[str, Any] = {
    "sync_mode": "whole-step",
    **{name: EDGCConfig.__dataclass_fields__[name].default
       for name in ("critical_threshold", "critical_low_rank", "lr_drop_factor", "noise_exponent")},
    "warmup_max_error": None,
}


def pipeline_refusal(config: EDGCConfig) -> str | None:
    """Why `config` cannot run on a pipeline's stages (under the DAC's stage alignment), or
    None: one answer for `edgc train --pp` and for a GradientSync given an alignment."""
    if config.policy in (*GROUP_POLICIES, "schedule"):
        return (f'EDGCConfig.policy={config.policy!r}: does not take the DAC\'s stage alignment yet; use "noise", '
                '"cqm", "linear", "critical" or "static" in a pipeline')
    if config.warmup_max_error is not None:
        # (each stage measures its own gradient, so the stages would end their warm-ups at
        # different steps, and the DAC's window-end exchange needs every stage compressing)
        return (f"EDGCConfig.warmup_max_error={config.warmup_max_error!r}: a pipeline's stages would end the "
                "warm-up at different steps; use None (a fixed warm-up, the default of edgc train with pp > 1)")
    return None


def reject_unknown_fields(cls: type, values: dict[str, Any], message: str) -> None:
    """Raise ValueError '<message> [...]; known: [...]' if `values` has keys that are not
    fields of the dataclass `cls` (shared by every config's from_dict)."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{message} {unknown}; known: {sorted(known)}")


# ---------------------------------------------------------------- field types, shared by every config

_INT_RANGE = (-(2**63), 2**63)  # what torch and numpy take as an integer
_WORDS = {int: "an integer", float: "a finite number", str: "text", bool: "true or false", dict: "a table of options"}
_METAVARS = {int: "INT", float: "FLOAT", str: "TEXT", bool: "BOOL", dict: "TABLE"}
_NULLS = ("null", "none")
_BOOLS = {"true": True, "false": False}
_INT_TEXT = re.compile(r"[+-]?\d+(_\d+)*")


@dataclass(frozen=True)
class FieldType:
    """What a config field holds, read from its annotation by `field_types`."""

    kind: type
    """int, float, str, bool, or dict (a table of another config's options, as TrainConfig.edgc)."""

    optional: bool = False
    """None is a value too (`int | None`): "null" on the command line, meaning unset."""

    def mismatch(self, value: Any) -> str | None:
        """None when `value` is of this type, else what it must be, in words ("an integer
        or null"). An int field takes no bool (True is an int in Python) and nothing
        outside 64 bits; a float field takes ints too, but not NaN or infinity."""
        if value is None:
            return None if self.optional else self.expected()
        if self.kind is not bool and isinstance(value, bool):
            return f"{self.expected()}, not true or false"
        if self.kind is int and isinstance(value, int) and not _INT_RANGE[0] <= value < _INT_RANGE[1]:
            return f"an integer in [-2**63, 2**63){' or null' if self.optional else ''}"
        if self.kind is float and isinstance(value, (int, float)):
            return None if math.isfinite(value) else self.expected()
        return None if isinstance(value, self.kind) else self.expected()

    def expected(self) -> str:
        """What a value of this type is, in words: "an integer", "a finite number or null", ..."""
        return _WORDS[self.kind] + (" or null" if self.optional else "")

    @property
    def metavar(self) -> str:
        """INT, FLOAT, TEXT or BOOL, with "|null" when optional (for the CLI's help)."""
        return _METAVARS[self.kind] + ("|null" if self.optional else "")

    def parse(self, text: str) -> Any:
        """The value that command-line `text` gives this field; raises ValueError
        "expected <what>, got '<text>'".

        - "null" or "none" (any case) is None where the field is optional;
        - an int field takes decimal digits with an optional sign, "_" allowed between
          digits as in Python and TOML ("524_288"); not "3.0", "1e3" or "true";
        - a float field takes what float() takes ("3e-4", "2"), but not NaN or infinity,
          nor what overflows to it ("1e400");
        - a bool field takes "true" or "false" (any case);
        - a text field takes the text as it is ("2024" stays the text "2024").
        """
        if self.optional and text.strip().lower() in _NULLS:
            return None
        if self.kind is str:
            return text
        value: bool | int | float | None
        if self.kind is bool:
            value = _BOOLS.get(text.strip().lower())
        elif self.kind is int:
            value = None
            if _INT_TEXT.fullmatch(text.strip()):
                # (more than 20 digits cannot fit in 64 bits, and int() refuses past 4300)
                value = int(text) if sum(c.isdigit() for c in text) <= 20 else _INT_RANGE[1]
        elif self.kind is float:
            try:
                value = float(text)
            except ValueError:
                value = None
        else:
            raise ValueError(f"{self.expected()} cannot be given as text")
        wanted = self.expected() if value is None else self.mismatch(value)
        if wanted is not None:
            raise ValueError(f"expected {wanted}, got {text!r}")
        return value


@functools.cache
def field_types(cls: type) -> dict[str, FieldType]:
    """The FieldType of each field of the dataclass `cls`, from its annotations (strings
    under `from __future__ import annotations`, so resolved by typing.get_type_hints).
    Raises TypeError for an annotation other than int, float, str, bool, dict[...], or
    one of them `| None`, so that a new kind of field cannot slip past the checks."""
    hints = typing.get_type_hints(cls)
    out: dict[str, FieldType] = {}
    for f in dataclasses.fields(cls):
        hint, optional = hints[f.name], False
        if typing.get_origin(hint) in (types.UnionType, typing.Union):
            rest = [a for a in typing.get_args(hint) if a is not type(None)]
            hint, optional = (rest[0] if len(rest) == 1 else hint), len(rest) < len(typing.get_args(hint))
        kind = typing.get_origin(hint) or hint
        if kind not in _WORDS:
            raise TypeError(f"{cls.__name__}.{f.name}: no rule for a field of type {hints[f.name]}")
        out[f.name] = FieldType(kind, optional)
    return out


def check_field_types(config: Any, bad: Callable[[str, str], Any]) -> None:
    """Call `bad(name, "must be <what>")`, which should raise, for the first field of the
    dataclass instance `config` whose value is not of its declared type (FieldType.mismatch),
    then for the first whose value is not among its class's CHOICES for it."""
    cls: type = type(config)
    for name, ftype in field_types(cls).items():
        wanted = ftype.mismatch(getattr(config, name))
        if wanted is not None:
            bad(name, f"must be {wanted}")
    for name, allowed in getattr(config, "CHOICES", {}).items():
        if getattr(config, name) not in allowed:
            bad(name, f"must be one of {allowed}")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of the dataclass `cls`, its whitespace folded to
    single spaces (for the CLI's help); {} when the class's source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    node = tree.body[0]
    assert isinstance(node, ast.ClassDef)  # (the source of a class)
    body = node.body
    docs: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs
