"""EDGC inside torchtitan: its HSDP replicate all-reduce compressed, from its own entry point.

    torchrun --nproc-per-node 8 -m torchtitan.train \\
        --module edgc.integrations.torchtitan --config llama3_8b \\
        --parallelism.data-parallel-replicate-degree 2 --edgc.max-rank 32

`--module edgc.integrations.torchtitan` takes any config function of torchtitan's models
(llama3_*, qwen3_*, deepseek_v3_*, ...; `pip install 'edgc[torchtitan]'`) and returns it
`with_edgc`: the same run, whose sync across `dp_replicate` goes through edgc. From a
config function of one's own, `with_edgc(config, max_rank=32)` does the same.

What changes against torchtitan's native HSDP (docs/torchtitan.md):

- Sharding: the model's own `parallelize_fn` runs as it is, but sees no replicate
  dimension, so `fully_shard` shards on `fsdp` alone; `edgc.fsdp.register_edgc` then
  hooks every FSDP unit (multi-module units included) over `("dp_replicate", "fsdp")`,
  from `ModelSpec.post_optimizer_build_fn` (chained after the model's own).
- Gradient scale: torchtitan sums gradients over data-parallel ranks (the loss is divided
  by the global token count, FSDP's divide factor is 1); edgc averages the replicas, then
  multiplies by their number (`register_edgc(..., reduce="sum")`).
- Gradient accumulation: the micro-batches before the last of a step are not synced
  (`set_requires_all_reduce(False)`): one compressed sync per optimiser step.
- The run's length scales the window and warm-up (`EDGCConfig(total_steps=--training.steps)`),
  and the learning rate's warm-up is the least warm-up (`warmup_min_steps`).
- edgc's state joins torchtitan's checkpoint (DCP, under the key "edgc"), one entry per
  rank, so that a resume is exact; its stats join the metrics (TensorBoard, W&B) as
  "edgc/*" and the console as one line after torchtitan's.
- Offline defaults: a config that points at torchtitan's test assets (the debug models:
  `tests/assets/tokenizer`, the `c4_test` data set, which the wheel does not ship) trains
  on edgc's built-in corpus instead (`EDGCCorpusDataLoader`: the Python standard
  library's sources, tokenised once into runs/.data by a 2048-token BPE, the debug
  models' vocabulary size).

Refused in one line, before the model is built: pipeline parallelism, context
parallelism, models with routed experts (MoE: torchtitan shards them on a per-parameter
mesh under expert parallelism, on which FSDP2 takes no all-reduce hook; without it, a
stacked expert weight would be compressed as one matrix, not one per expert), the
chunked loss (`_CHUNKED`: with_edgc replaces it by its inner loss), a run without replicas to sync
(`--parallelism.data-parallel-replicate-degree` 1), an SPMD backend other than
"partial_dtensor", CUDA graphs, and any invalid edgc setting (`max_rank` None included: calibration
is not built for FSDP).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import math
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from edgc.integrations import _require, _tell_learning_rate, log_values

_require("torchtitan", "torchtitan", "edgc.integrations.torchtitan")

import torch  # noqa: E402
import tyro  # noqa: E402
from torch.distributed.checkpoint.stateful import Stateful  # noqa: E402
from torch.utils.data import IterableDataset  # noqa: E402
from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402
from torchtitan.components.loss import ChunkedLossWrapper  # noqa: E402
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader  # noqa: E402
from torchtitan.models.common.moe import MoE  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from edgc.config import EDGCConfig, flat_sections  # noqa: E402
from edgc.data.prepare import builtin_folder, ensure_builtin  # noqa: E402
from edgc.data.tokens import TokenFile  # noqa: E402
from edgc.fields import field_docs, field_types  # noqa: E402
from edgc.fsdp import EDGCFSDPState, register_edgc  # noqa: E402

logger = logging.getLogger(__name__)

__all__ = ["BUILTIN_DATA", "TESTED_TORCHTITAN", "EDGCCorpusDataLoader", "EDGCSettings", "EDGCTrainer", "with_edgc"]

#: The torchtitan release this module was tested with (the extra pins it).
TESTED_TORCHTITAN = "0.3.0"

#: The built-in corpus, tokenised as `edgc train` does by default (and shared with it).
BUILTIN_DATA = str(builtin_folder("runs/.data"))

#: Markers of torchtitan's test assets, which its wheel does not ship.
_TEST_ASSETS = "tests/assets"
_TEST_DATASETS = ("c4_test", "c4_validation")

#: The EDGCConfig fields torchtitan's command line takes as --edgc.FIELD: every field but
#: the run's length (--training.steps is it) and a registered policy's own table.
_NOT_FLAGS = ("total_steps", "policy_settings")


def _settings_class() -> type:
    """EDGCSettings: one field per EDGCConfig field (each section's flat, "noise_exponent"),
    None meaning the run's default, so that only what a user gives is given."""
    fields: list[tuple[str, Any, Any]] = [
        ("enable", Annotated[bool, tyro.conf.arg(help="compress the replicate sync with edgc; --edgc.no-enable: "
                                                      "torchtitan's native HSDP on the same config (a baseline)")],
         True),
        ("max_rank", Annotated[int | None, tyro.conf.arg(help="r_max (edgc's default under torchtitan: 32; None, "
                                                              "calibration, is not built for FSDP)")], 32),
    ]
    docs = field_docs(EDGCConfig)
    for name, ftype in field_types(EDGCConfig).items():
        if name in _NOT_FLAGS or name == "max_rank":
            continue
        inner = [(f"{name}_{k}", t, field_docs(ftype.kind).get(k, "")) for k, t in field_types(ftype.kind).items()] \
            if ftype.section else [(name, ftype, docs.get(name, ""))]
        for flat, kind, doc in inner:
            help_text = " ".join(doc.split()) + " (None: the run's default)"
            fields.append((flat, Annotated[kind.kind | None, tyro.conf.arg(help=help_text)], None))
    cls = dataclasses.make_dataclass("EDGCSettings", [(n, t, field(default=d)) for n, t, d in fields],
                                     kw_only=True)
    cls.__module__ = __name__
    cls.__doc__ = ("edgc's settings in a torchtitan config (`--edgc.FIELD`): EDGCConfig's fields, each section's as "
                   "SECTION_FIELD; None is the run's default (window and warm-up scaled to --training.steps).")
    return cls


EDGCSettings: Any = _settings_class()


def _given(settings: Any) -> dict[str, Any]:
    """The EDGCConfig fields `settings` gives (not None), flat."""
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)
            if f.name != "enable" and getattr(settings, f.name) is not None}


class EDGCTrainer(Trainer):
    """torchtitan's Trainer with its replicate sync compressed by edgc (`with_edgc`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        edgc: EDGCSettings = field(default_factory=EDGCSettings)
        """edgc's settings (`--edgc.FIELD`; docs/torchtitan.md)."""

        def __post_init__(self) -> None:
            Trainer.Config.__post_init__(self)
            if self.edgc.enable:  # (the layout is checked by the trainer: a config function's is not final)
                self.edgc_config()  # (raises ValueError naming an invalid field)

        def edgc_config(self) -> EDGCConfig:
            """The run's EDGCConfig: the given settings, the rest scaled to --training.steps,
            and a gradient-ended warm-up that lasts at least the learning rate's."""
            given = _given(self.edgc)
            if self.edgc.max_rank is None:  # (its default is 32, not None)
                raise ValueError("edgc with torchtitan: max_rank=None (calibrating r_max by timing) is not built for "
                                 "FSDP; give --edgc.max-rank, e.g. 32")
            values: dict[str, Any] = {"total_steps": self.training.steps, **given}
            warmup = EDGCConfig.from_dict(values)
            if warmup.warmup == "gradient" and "warmup_min_steps" not in given:
                values["warmup_min_steps"] = min(max(0, int(self.lr_scheduler.warmup_steps)), warmup.warmup_steps)
            return EDGCConfig.from_dict(values)

    config: Config

    def __init__(self, config: Config) -> None:
        self.edgc_state: EDGCFSDPState | None = None
        self._micro = 0  # micro-batches run in this optimiser step
        spec = config.model_spec
        if config.edgc.enable and spec is not None:
            refusal = _layout_refusal(config)
            if refusal is not None:
                raise ValueError(f"edgc with torchtitan: {refusal}")
            self._edgc_config = config.edgc_config()
            vocab = getattr(config.loss, "global_vocab_size", 0) or 0
            logits = config.training.local_batch_size * config.training.seq_len * vocab * 4
            logger.info("edgc: a micro-batch's logits are computed whole, %.2f GiB in float32 (not chunked: %s)",
                        logits / 2**30, _CHUNKED)
            config.model_spec = dataclasses.replace(
                spec, parallelize_fn=_shard_only(spec.parallelize_fn),
                post_optimizer_build_fn=functools.partial(self._register, spec.post_optimizer_build_fn))
        for path in _builtin_paths(config):
            ensure_builtin(path)
        super().__init__(config)
        if self.edgc_state is None:
            return
        if config.checkpoint.enable:  # (its own entry: --checkpoint.exclude-from-loading edgc leaves it out)
            self.checkpointer.states["edgc"] = self.edgc_state
        self.metrics_processor.log = functools.partial(_log_with_edgc, self.metrics_processor.log, self.edgc_state)

    def _register(self, previous: Callable | None, optimizers: Any, model_parts: list[torch.nn.Module],
                  parallel_dims: Any) -> None:
        """ModelSpec.post_optimizer_build_fn: the model's own (MoE models have one), then
        edgc's hooks on the sharded model."""
        if previous is not None:
            previous(optimizers, model_parts, parallel_dims)
        mesh = parallel_dims.get_mesh(["dp_replicate", "fsdp"])
        self.edgc_state = register_edgc(model_parts[0], mesh, self._edgc_config, replicate_dim="dp_replicate",
                                        shard_dim="fsdp", reduce="sum")
        logger.info("edgc compresses the sync across %s replicas (%s shards, %s TP ranks each): %s",
                    *self.edgc_state.layout, self._edgc_config)

    def forward_backward_step(self, **kwargs: Any) -> torch.Tensor:
        """One micro-batch. With gradient accumulation, only the step's last one syncs the
        replicas (set_requires_all_reduce), so each step sends one compressed sync."""
        if self.edgc_state is not None:
            self._micro += 1
            last = self._micro == self.gradient_accumulation_steps
            if last:
                self._micro = 0
            if self.gradient_accumulation_steps > 1:
                for part in self.model_parts:
                    typing.cast(Any, part).set_requires_all_reduce(last)
        return super().forward_backward_step(**kwargs)

    def train_step(self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]) -> None:
        if self.edgc_state is not None:  # (the rate of the step about to run: edgc's policies read its drops)
            _tell_learning_rate(typing.cast(Any, self.edgc_state), self.optimizers)
        super().train_step(data_iterator)


#: Why the chunked loss is replaced by its inner loss.
_CHUNKED = ("torchtitan's ChunkedLossWrapper runs the output layer's backward once per chunk, so FSDP reduces that "
            "unit several times a step, each time for part of its parameters, while edgc syncs each unit once a step "
            "(as the whole gradient it compresses); edgc computes a micro-batch's logits whole instead "
            "(local batch x seq_len x vocab floats), as torchtitan's *_ce_loss configs do")


def _layout_refusal(config: Any) -> str | None:
    """Why edgc cannot serve this torchtitan config's layout, or None."""
    if isinstance(config.loss, ChunkedLossWrapper.Config):
        return f"--loss is a ChunkedLossWrapper: {_CHUNKED} (with_edgc sets it)"
    spec = config.model_spec
    if spec is not None and any(spec.model.traverse(MoE.Config)):
        return (f"{spec.name} {spec.flavor} has routed experts, which edgc does not compress under torchtitan yet: "
                "with expert parallelism torchtitan shards them on a per-parameter mesh, where FSDP2 takes no "
                "all-reduce hook, and without it each stacked [experts, out, in] weight would be compressed as one "
                "(experts, out x in) matrix instead of one matrix per expert (edgc.moe does that, under edgc "
                "train --ep)")
    if not config.training.disable_cuda_graphs:
        return ("CUDA graphs would replay one captured step, and edgc's hook decides on the host at every step "
                "(its phase, rank and window): give --training.disable-cuda-graphs (with_edgc sets it)")
    p = config.parallelism
    if p.spmd_backend != "partial_dtensor":
        return (f"--parallelism.spmd-backend {p.spmd_backend} is not supported: edgc hooks FSDP2's all-reduce on a "
                "1-D shard mesh, which the partial_dtensor backend builds (with_edgc sets it)")
    for flag, degree, why in (
            ("pipeline-parallel-degree", p.pipeline_parallel_degree, "compressing pipeline stages is edgc train "
                                                                     "--pp's, not built for torchtitan yet"),
            ("context-parallel-degree", p.context_parallel_degree, "not built for torchtitan yet"),
            ("expert-parallel-degree", p.expert_parallel_degree, "torchtitan shards routed experts on a "
                                                                 "per-parameter mesh, on which FSDP2 takes no "
                                                                 "all-reduce hook")):
        if degree != 1:
            return f"--parallelism.{flag} {degree}: {why}"
    if p.data_parallel_replicate_degree < 2:
        return ("--parallelism.data-parallel-replicate-degree is 1: edgc compresses the all-reduce across replicas, "
                "and there is none; give it 2 or more (HSDP), or --edgc.no-enable")
    return None


def _shard_only(parallelize: Callable) -> Callable:
    """The model's parallelize_fn, run as if there were no replicate dimension: every
    torchtitan model shards on ["dp_replicate", "fsdp"] when `dp_replicate_enabled`, else
    on ["fsdp"], which is what edgc's hook needs (it syncs the replicas itself)."""

    @functools.wraps(parallelize)
    def shard_only(model: torch.nn.Module, *, parallel_dims: Any, **kwargs: Any) -> torch.nn.Module:
        return parallelize(model, parallel_dims=_NoReplicate(parallel_dims), **kwargs)

    return shard_only


class _NoReplicate:
    """A torchtitan ParallelDims that reports no replicate dimension, the rest its own."""

    dp_replicate_enabled = False

    def __init__(self, dims: Any) -> None:
        self._dims = dims

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dims, name)


def _log_with_edgc(log: Callable, state: EDGCFSDPState, step: int, *args: Any,
                   extra_metrics: dict[str, Any] | None = None, **kwargs: Any) -> None:
    """MetricsProcessor.log with edgc's stats among its metrics ("edgc/rank", ...) and one
    console line after torchtitan's."""
    stats = state.stats()
    values = {**log_values(stats), "edgc/bytes_uncompressed": float(stats.bytes_uncompressed),
              "edgc/compress_seconds": stats.compress_seconds}
    log(step, *args, extra_metrics={**(extra_metrics or {}), **values}, **kwargs)
    sent = f"rank {stats.step_rank}" if stats.step_phase == "compress" else "sent whole (warm-up)"
    ratio = stats.bytes_sent / stats.bytes_uncompressed if stats.bytes_uncompressed else math.nan
    logger.info("edgc step %2d: %s  bytes sent so far %.3fx of uncompressed  compression time so far %.1f ms", step,
                sent, ratio, 1e3 * stats.compress_seconds)


def _builtin_paths(config: Any) -> list[str]:
    """The built-in corpus folders this config reads, to prepare before the run."""
    loaders = [config.dataloader, getattr(config.validator, "dataloader", None)]
    paths = {config.hf_assets_path} if Path(config.hf_assets_path) == Path(BUILTIN_DATA) else set()
    paths |= {BUILTIN_DATA for d in loaders if isinstance(d, EDGCCorpusDataLoader.Config) and not d.dataset_path}
    return sorted(paths)


# ------------------------------------------------------------------ data that ships with edgc


class _Windows(IterableDataset, Stateful):
    """Consecutive windows of seq_len + 1 tokens of a token file, dealt out to the
    data-parallel ranks in turn (window i to rank i mod ranks), each window once per pass
    (the last few left out, so that every rank takes as many: a pass that ends does so on
    every rank alike); the state is the number of windows this rank has taken."""

    def __init__(self, path: Path, seq_len: int, dp_rank: int, dp_world_size: int, infinite: bool) -> None:
        self.tokens = TokenFile(path)
        self.seq_len, self.rank, self.ranks, self.infinite = seq_len, dp_rank, dp_world_size, infinite
        self.windows = (len(self.tokens) - 1) // seq_len
        if self.windows < dp_world_size:
            raise ValueError(f"{path} holds {len(self.tokens)} tokens: fewer than one window of "
                             f"--training.seq-len {seq_len} + 1 for each of the {dp_world_size} data-parallel ranks")
        self.taken = 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        per_pass = self.windows // self.ranks  # (every rank's windows in one pass: as many on each)
        positions = torch.arange(self.seq_len)
        while self.infinite or self.taken < per_pass:
            window = self.rank + (self.taken % per_pass) * self.ranks
            start = window * self.seq_len
            ids = torch.from_numpy(self.tokens.tokens[start:start + self.seq_len + 1].astype("int64"))
            self.taken += 1
            yield {"input": ids[:-1], "positions": positions}, ids[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"taken": self.taken}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.taken = int(state_dict["taken"])


class EDGCCorpusDataLoader(ParallelAwareDataloader):
    """A torchtitan data loader over a folder prepared by edgc (`edgc prepare`, or the
    built-in corpus, prepared on first use): its train.bin or val.bin, in windows of
    --training.seq-len tokens, with positions (one causal document per window)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        dataset: str = "edgc-builtin"
        """The data's name (shown in logs); the data is `dataset_path`'s."""

        dataset_path: str | None = None
        """A folder prepared by `edgc prepare`; None: edgc's built-in corpus (BUILTIN_DATA)."""

        split: str = "train"
        """"train" (train.bin) or "val" (val.bin)."""

        infinite: bool = True
        """Loop over the data; False: one pass (the validator's, with --validator.steps -1)."""

        def __post_init__(self) -> None:
            if self.split not in ("train", "val"):
                raise ValueError(f'EDGCCorpusDataLoader: split {self.split!r} must be "train" or "val"')

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: Any, seq_len: int,
                 local_batch_size: int, snapshot_every_n_steps: int | None = 1, **kwargs: Any) -> None:
        folder = Path(config.dataset_path) if config.dataset_path else ensure_builtin(BUILTIN_DATA)
        windows = _Windows(folder / f"{config.split}.bin", seq_len, dp_rank, dp_world_size, config.infinite)
        vocab = getattr(tokenizer, "get_vocab_size", lambda: None)()
        if vocab is not None and windows.tokens.vocab_size > vocab:
            raise ValueError(f"{folder} was tokenised into {windows.tokens.vocab_size} token ids, more than the "
                             f"tokenizer at hf_assets_path has ({vocab})")
        super().__init__(windows, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=local_batch_size,
                         num_workers=config.num_workers, pin_memory=config.pin_memory,
                         snapshot_every_n_steps=snapshot_every_n_steps)


# ------------------------------------------------------------------ configs


def with_edgc(config: Any, **settings: Any) -> EDGCTrainer.Config:
    """torchtitan's Trainer.Config `config` as an EDGCTrainer.Config: the same run, its
    replicate sync compressed by edgc with `settings` (EDGCConfig fields, sections flat or
    as tables; what is not given is the run's default: max_rank 32, the window and warm-up
    scaled to --training.steps). Also sets the SPMD backend edgc needs (partial_dtensor),
    no CUDA graphs (edgc's hook decides on the host each step), the chunked loss's inner
    loss in its place (`_CHUNKED`), and the built-in corpus in place of torchtitan's test
    assets. Raises TypeError for a
    config of another trainer class, ValueError naming an invalid setting."""
    if type(config) is not Trainer.Config:
        raise TypeError(f"with_edgc takes torchtitan's Trainer.Config; got {type(config).__name__} (a trainer of "
                        "its own is not adapted)")
    flat = flat_sections({k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) and not isinstance(v, type) else v
                          for k, v in settings.items()})
    known = {f.name for f in dataclasses.fields(EDGCSettings)}
    if unknown := sorted(set(flat) - known):
        raise ValueError(f"with_edgc: no edgc setting(s) {unknown}; known: {sorted(known)}")
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(Trainer.Config) if f.init}
    values["parallelism"] = dataclasses.replace(config.parallelism, spmd_backend="partial_dtensor")
    values["training"] = dataclasses.replace(config.training, disable_cuda_graphs=True)
    if isinstance(values["loss"], ChunkedLossWrapper.Config):  # (one sync per unit and step: see _chunked)
        values["loss"] = values["loss"].loss_fn
    _builtin_data(values)
    return EDGCTrainer.Config(**values, edgc=EDGCSettings(**flat))


def _builtin_data(values: dict[str, Any]) -> None:
    """Point a config that reads torchtitan's test assets (not in its wheel) at edgc's
    built-in corpus instead: its tokenizer and its train and val splits."""
    if _TEST_ASSETS in str(values["hf_assets_path"]):
        values["hf_assets_path"] = BUILTIN_DATA
    loader = values["dataloader"]
    if isinstance(loader, HuggingFaceTextDataLoader.Config) and loader.dataset in _TEST_DATASETS:
        values["dataloader"] = EDGCCorpusDataLoader.Config(infinite=loader.infinite)
    validator = values["validator"]
    v_loader = getattr(validator, "dataloader", None)
    if isinstance(v_loader, HuggingFaceTextDataLoader.Config) and v_loader.dataset in _TEST_DATASETS:
        values["validator"] = dataclasses.replace(
            validator, dataloader=EDGCCorpusDataLoader.Config(split="val", infinite=v_loader.infinite))


def _families() -> list[str]:
    from torchtitan.models import _supported_models

    return sorted(_supported_models, key=len, reverse=True)


def _torchtitan_config(name: str) -> Callable[[], Any] | None:
    """torchtitan's config function `name` (llama3_debugmodel, qwen3_0_6b, ...), or None."""
    families = _families()
    ordered = [f for f in families if name.startswith(f)] + [f for f in families if not name.startswith(f)]
    for family in ordered:
        try:
            registry = importlib.import_module(f"torchtitan.models.{family}.config_registry")
        except ImportError:
            continue
        fn = getattr(registry, name, None)
        if callable(fn):
            return fn
    return None


def __getattr__(name: str) -> Any:
    """torchtitan's config function `name`, returning its config `with_edgc` (this module
    as `--module`: `--config llama3_debugmodel`)."""
    if name.startswith("_"):
        raise AttributeError(name)
    fn = _torchtitan_config(name)
    if fn is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}: neither edgc's nor a config function "
                             f"of torchtitan's models ({', '.join(_families())})")

    @functools.wraps(fn)
    def config() -> EDGCTrainer.Config:
        return with_edgc(fn())

    return config

