"""EDGC for FSDP2 and HSDP: shard inside a node, compress only the inter-node sync.

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from edgc import EDGCConfig
    from edgc.fsdp import register_edgc

    mesh = init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("replicate", "shard"))
    for block in model.h:  # (edgc.models' GPT: its transformer blocks)
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    state = register_edgc(model, mesh, EDGCConfig(max_rank=32, total_steps=steps))  # before the first backward

How it fits FSDP2. A module sharded over the 1-D "shard" mesh reduce-scatters its
gradient inside the node and runs no all-reduce of its own: its
`FSDPModule.set_all_reduce_hook` hook is then the only step across nodes (torch calls
this layout "custom HSDP"). register_edgc sets that hook on every FSDPModule. FSDP hands
the hook the module's reduce-scatter output, one flat buffer holding each parameter's
dim-0 shard padded to ceil(dim0 / S) rows, in the module's parameter order; the hook
must average it over the replicate group, in place, before it returns. A 2-D shard is a
block of rows, a matrix, so the compression core (edgc.comm.sync.GradientSync, the one
behind the DDP hook) takes each buffer as it is, in its eager mode: error feedback,
warm-started Q, every policy, the GDS entropy and the warm-up, with the collectives on
the replicate group and the decisions agreed over the whole mesh, so every shard
compresses at the same rank. Padding rows are zero in every replica's gradient and stay
zero through P, Q and the error feedback.

Units of several modules. `fully_shard([norm, head])` (or tied weights, `[emb, head]`)
makes one FSDP state, one parameter group and one hook for the modules it names: edgc
hooks such a unit once, named "norm+head".

Gradient scale. The replicas' gradients are averaged (`reduce="mean"`), as native HSDP
does with FSDP's default divide factor; `reduce="sum"` sums them, as native HSDP does after
`set_gradient_divide_factor(1.0)` (torchtitan, which divides its loss by the global token
count): the average is compressed and sent, then multiplied by the number of replicas.

Tensor parallelism. A model split with torch's `parallelize_module` on a "tp" dimension of
the same mesh, ("replicate", "shard", "tp"), then sharded on mesh["shard"], is registered
with the 2-D slice, `register_edgc(model, mesh["replicate", "shard"], config)`. Where the
meshes were unflattened from a 1-D world mesh (torchtitan's), the TP dimension is read off
a split parameter's own mesh instead, and the stage's processes are joined with one
all_gather_object at registration. FSDP then
hands the hook each TP rank's local shards, and each is compressed over that TP rank's own
replicate group (no gradient crosses TP ranks). The decisions are agreed over the stage's
replicate x shard x tp group (built here by every process, for every stage, in one order).
Tensors TP leaves whole (outside the plan, or Replicate on the TP dimension) get the same
gradient on every TP rank, are compressed alike (same shapes, same Q from the same seed,
same rank: checked once, `_check_same_shards`) and so stay bit-identical; the signals
count them on the first TP rank only (CompressionState.uncounted).

Mixtures of experts (edgc.moe, docs/moe.md). With `expert_mesh`, the FSDPModules sharded
on the expert mesh's shard dimension (its own process groups, even over the same ranks)
are the experts': a second core compresses them over the expert mesh's replicate group,
with their own state and rank, each stacked [E', out, in] parameter as E' matrices.

Gradient accumulation. On a 1-D shard mesh FSDP calls the hook on every micro-batch that
reduce-scatters. Call `model.set_requires_all_reduce(False)` before the micro-batches that
should not sync and `set_requires_all_reduce(True)` before the last, exactly as with
native HSDP: on the others the hook keeps the reduce-scatter output in a local sum (and
hands FSDP zeros), and the syncing micro-batch sends the whole sum, as native HSDP does.
`model.set_requires_gradient_sync(False)` (no reduce-scatter at all) needs nothing.

Checkpoints. `state.state_dict()` holds this process's error feedback, Q and policy state
under a key of its own global rank, as one opaque value, beside the layout; saved with
`torch.save` per rank or with `torch.distributed.checkpoint` inside the app state, every
rank's value is kept (DCP stores each rank's own key), and `load_state_dict` takes it
back, refusing a checkpoint of another replicate × shard × tp layout and naming both. A
checkpoint is taken between optimiser steps: a local accumulation sum is not in it.

Refused before the first step, with the reason: a model with no FSDPModule, one sharded on
the 2-D mesh (native HSDP: its own all-reduce would run too), a module with several
parameter groups, parameters sharded on a dim other than 0, a mesh without the named
dimensions, a shard mesh other than the given one, TP shards of unequal shapes, and
`max_rank=None` (calibration times the whole local gradient at once). At a step: a
buffer whose size differs from the layout worked out from the parameters (a parameter
without a gradient: every one needs one).
"""

from __future__ import annotations

import functools
import io
import logging
import math
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from edgc.checkpoint import resized_state
from edgc.comm.baselines import NativeHSDPState
from edgc.comm.compression import Entry
from edgc.comm.facade import SyncState
from edgc.comm.stats import EDGCStats
from edgc.comm.sync import GradientSync
from edgc.config import EDGCConfig
from edgc.fsdp_internals import ModuleParams, fsdp_state, module_params
from edgc.fsdp_layout import TensorParallel, stage_group, tensor_parallel
from edgc.safeload import load_torch

logger = logging.getLogger(__name__)

__all__ = ["EDGCFSDPState", "count_native_hsdp", "register_edgc"]

_FORMAT = "edgc-fsdp-state"


@dataclass
class _Module:
    """One hooked FSDPModule: its parameter group and its buffer's layout."""

    name: str
    group: ModuleParams  # its parameter group (its all_reduce_grads flag is read at every call)
    entries: list[Entry]  # ((module index, parameter index), padded shard shape), in buffer order
    numel: int  # the buffer's size
    accumulated: torch.Tensor | None = None  # local sum of micro-batches not synced yet
    expert: bool = False  # sharded on the expert mesh: synced by the experts' own core


class EDGCFSDPState(SyncState):
    """The EDGC state of one FSDP2 model: the compression core and one hook per
    FSDPModule (built by register_edgc). What a user reads and sets (stats, enabled,
    set_grad_scale, set_learning_rate, ...) is SyncState's, as on EDGCState; state_dict
    and load_state_dict hold this process's shards under its global rank."""

    def __init__(self, modules: list[_Module], sync: GradientSync, layout: tuple[int, int, int],
                 expert_sync: GradientSync | None = None, ep: int = 1, reduce: str = "mean"):
        self._modules = modules
        self.reduce = reduce  # "mean" or "sum" over the replicas (register_edgc)
        self.sync = sync
        self.layout = layout  # (replicate, shard, tp) sizes
        self.expert_sync = expert_sync  # the experts' core (register_edgc(..., expert_mesh=...)), else None
        self.ep = ep  # expert-parallel ranks (1 without experts)
        self._calls = {False: 0, True: 0}  # modules synced so far in this step, dense and experts
        self._count = {e: sum(m.expert == e for m in modules) for e in (False, True)}

    def stats(self) -> EDGCStats:
        """This process's counters; bytes are those handed to collectives across the
        replicate group (the inter-node wire), and bytes_uncompressed what native HSDP's
        all-reduce of the same shards would have sent. With experts, the dense
        parameters' only (`expert_stats` gives the experts')."""
        return self.sync.stats()

    def expert_stats(self) -> EDGCStats | None:
        """The experts' counters (their all-reduce over the expert replicate group, their
        rank and signals), or None without experts."""
        return self.expert_sync.stats() if self.expert_sync is not None else None

    def _syncs(self) -> list[GradientSync]:
        return [self.sync] + ([self.expert_sync] if self.expert_sync is not None else [])

    @property
    def enabled(self) -> bool:
        """SyncState.enabled; with experts, set on both cores."""
        return self.sync.enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        for sync in self._syncs():
            sync.enabled = bool(on)

    def set_grad_scale(self, scale: float) -> None:
        for sync in self._syncs():
            sync.set_grad_scale(scale)

    def set_learning_rate(self, lr: float) -> None:
        for sync in self._syncs():
            sync.set_learning_rate(lr)

    def _key(self) -> str:
        return f"rank{dist.get_rank() if dist.is_initialized() else 0}"

    def state_dict(self) -> dict[str, Any]:
        """{"format", "layout": [replicate, shard, tp], "rank<global rank>": this process's
        compression state as bytes}: see the module doc. With experts, also "ep" and
        "experts-rank<global rank>": the experts' core's state."""
        out: dict[str, Any] = {"format": _FORMAT, "layout": list(self.layout), self._key(): _blob(self.sync)}
        if self.expert_sync is not None:
            out["ep"] = self.ep
            out[f"experts-{self._key()}"] = _blob(self.expert_sync)
        return out

    def load_state_dict(self, d: dict[str, Any], *, strict_replica: bool = True, trust: bool = False) -> None:
        """Restore this process's state from state_dict() (or a DCP load into it), before
        the first step. Raises ValueError on another layout, naming both, or a state
        without this rank's entry, and edgc.safeload.UnsafeFileError on an entry that names
        code to run unless `trust` (only for a state one trusts)."""
        if not isinstance(d, dict) or d.get("format") != _FORMAT:
            raise ValueError(f"not an EDGC FSDP state dict (missing format marker {_FORMAT!r})")
        saved = (*(int(x) for x in d["layout"]), 1)[:3]  # (states saved before TP hold [replicate, shard])
        if saved != self.layout or int(d.get("ep", 1)) != self.ep:
            raise ValueError(f"EDGC FSDP state was saved by a layout of {_say(saved, int(d.get('ep', 1)))}, but this "
                             f"job has {_say(self.layout, self.ep)}; error feedback is per shard and cannot be "
                             "remapped")
        if self.expert_sync is not None and f"experts-{self._key()}" not in d:
            raise ValueError(f"EDGC FSDP state dict holds no experts' state for this process (experts-{self._key()})")
        self.sync.load_state_dict(_entry(d, self._key(), trust), strict_replica=strict_replica)
        if self.expert_sync is not None:
            self.expert_sync.load_state_dict(_entry(d, f"experts-{self._key()}", trust), strict_replica=strict_replica)

    def load_resized(self, states: list[dict[str, Any]], *, trust: bool = False) -> None:
        """Restore this process's state from the state_dict() of every process of a job
        with another number of replicas, the same shards and TP ranks (edgc train
        --resume on another --dp-replicate), before the first step: the old replicas'
        states at this process's shard and TP rank, resized to this job's replicas
        (edgc.checkpoint.resize_states: Q and the policy's state from the first, each
        replica's error feedback their mean). Global ranks are taken as the mesh
        (replicate, shard, tp) laid out in rank order, as init_device_mesh does. Raises
        ValueError on other shards or TP ranks, naming both layouts."""
        if not states or not isinstance(states[0], dict) or states[0].get("format") != _FORMAT:
            raise ValueError(f"not a list of EDGC FSDP state dicts (missing format marker {_FORMAT!r})")
        saved = (*(int(x) for x in states[0]["layout"]), 1)[:3]
        if self.expert_sync is not None or int(states[0].get("ep", 1)) != 1:
            raise ValueError("EDGC FSDP states with experts resume on the same layout only: the experts' error "
                             "feedback is per expert-parallel rank and cannot be resized to other replicas")
        if saved[1:] != self.layout[1:]:
            raise ValueError(f"EDGC FSDP state was saved by a layout of {_say(saved)}, but this job has "
                             f"{_say(self.layout)}: only the number of replicas may change")
        _, shard, tp = self.layout
        rank = dist.get_rank() if dist.is_initialized() else 0
        replica, within = divmod(rank, shard * tp)  # (within: this process's shard and TP rank, shard * tp + t)
        olds = [j * shard * tp + within for j in range(saved[0])]
        by_key = {key: d for d in states for key in d if key.startswith("rank")}
        missing = [f"rank{r}" for r in olds if f"rank{r}" not in by_key]
        if missing:
            raise ValueError(f"the EDGC FSDP states hold no entry for {', '.join(missing)}")
        inner = [_entry(by_key[f"rank{r}"], f"rank{r}", trust) for r in olds]
        self.sync.load_state_dict(resized_state(inner, self.layout[0], replica))

    def _hook(self, index: int, output: torch.Tensor) -> None:
        """FSDP's all-reduce hook of module `index`: average `output` over the replicate
        group in place (or keep it for a later micro-batch)."""
        module = self._modules[index]
        if output.numel() != module.numel:
            raise ValueError(
                f"EDGC: FSDP handed module {module.name!r} a gradient buffer of {output.numel()} elements, but its "
                f"parameters' shards make {module.numel}; every parameter needs a gradient in every step")
        if not module.group.all_reduce_grads:  # set_requires_all_reduce(False): keep it for later
            if module.accumulated is None:
                module.accumulated = output.detach().clone()
            else:
                module.accumulated.add_(output)
            output.zero_()
            return
        if module.accumulated is not None:
            output.add_(module.accumulated)
            module.accumulated = None
        kind = module.expert
        self._calls[kind] += 1
        last = self._calls[kind] == self._count[kind]
        if last:
            self._calls[kind] = 0
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        sync = self.expert_sync if kind else self.sync
        assert sync is not None  # (expert modules only with an experts' core)
        sync.receive(output, module.entries, future, last)
        if not future.done():  # (the eager core completes every buffer in its own call)
            raise RuntimeError("EDGC: a module's gradient was not averaged within FSDP's hook")
        if self.reduce == "sum":  # (the replicas' sum, as native HSDP with a divide factor of 1)
            output.mul_(self.layout[0])


def _entry(d: dict[str, Any], key: str, trust: bool) -> dict[str, Any]:
    """The compression state in entry `key` of an EDGC FSDP state dict, unpacked."""
    if key not in d:
        raise ValueError(f"EDGC FSDP state dict has no entry for this process ({key})")
    blob = d[key]  # (bytes; a uint8 tensor in edgc train's checkpoints: edgc.comm.replicas.blobs_as_tensors)
    data = blob.numpy().tobytes() if isinstance(blob, torch.Tensor) else blob
    return load_torch(data, what=f"EDGC FSDP state entry {key!r}", how="load_state_dict(..., trust=True)",
                      trust=trust)


def _blob(sync: GradientSync) -> bytes:
    blob = io.BytesIO()
    torch.save(sync.state_dict(copy=False), blob)  # (serialised here: no copy of the error first)
    return blob.getvalue()


def _say(layout: tuple[int, ...], ep: int = 1) -> str:
    experts = f" ({ep} expert-parallel ranks)" if ep > 1 else ""
    return f"{layout[0]} replicas x {layout[1]} shards x {layout[2]} TP ranks{experts}"


def count_native_hsdp(model: nn.Module, mesh: DeviceMesh, *, replicate_dim: str = "replicate",
                      expert_mesh: DeviceMesh | None = None) -> NativeHSDPState:
    """Counters for a model sharded natively on the whole 2-D mesh (the baseline): an
    all-reduce hook on every FSDPModule that only counts the bytes FSDP's own all-reduce
    across `mesh[replicate_dim]` handled (the hook runs after it). With `expert_mesh`
    (edgc.moe.expert_mesh), the FSDPModules sharded natively on its (replicate, shard)
    slice are the experts': counted apart (the state's `expert_state`), and their divide
    factor set to the whole data-parallel degree, as register_edgc does (edgc.moe)."""
    from torch.distributed.fsdp import FSDPModule

    hooked, seen = [], set()  # (one module per unit: fully_shard([a, b]) shares one state)
    for m in model.modules():
        if isinstance(m, FSDPModule) and id(fsdp_state(m)) not in seen:
            seen.add(id(fsdp_state(m)))
            if module_params(m):
                hooked.append(m)
    if not hooked:
        raise ValueError("count_native_hsdp found no FSDPModule with parameters in the model")
    experts: list[Any] = []
    if expert_mesh is not None:
        ranks = _ranks(expert_mesh[replicate_dim].get_group())
        experts = [m for m in hooked if module_params(m)[0].native_hsdp and _replicate_ranks(m) == ranks
                   and _replicate_ranks(m) != _ranks(mesh[replicate_dim].get_group())]
    dense = [m for m in hooked if not any(m is e for e in experts)]
    state = NativeHSDPState(mesh[replicate_dim].get_group(), len(dense))
    for m in dense:
        m.set_all_reduce_hook(state.count)
    if experts:
        assert expert_mesh is not None
        state.expert_state = NativeHSDPState(expert_mesh[replicate_dim].get_group(), len(experts))
        gloo = dist.get_backend(mesh[replicate_dim].get_group()) == "gloo"
        for m in experts:
            m.set_gradient_divide_factor(float(mesh.size()))
            if gloo:  # (gloo has no pre-multiplied sum: sum, then divide)
                m.set_force_sum_reduction_for_comms(True)
            m.set_all_reduce_hook(state.expert_state.count)
    return state


def _replicate_ranks(module: Any) -> list[int]:
    """The ranks a natively HSDP-sharded module all-reduces over."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
    return _ranks(groups[0].mesh_info.replicate_process_group)


def _mesh_groups(mesh: DeviceMesh, replicate: str, shard: str) -> tuple[DeviceMesh, DeviceMesh]:
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2 or replicate not in names or shard not in names:
        raise ValueError(f"register_edgc needs a 2-D DeviceMesh with dimensions named {replicate!r} and {shard!r} "
                         f"(init_device_mesh(..., mesh_dim_names=({replicate!r}, {shard!r}))); got dimensions "
                         f"{names or None} of shape {tuple(mesh.shape)}")
    return mesh[replicate], mesh[shard]


def _ranks(group: dist.ProcessGroup) -> list[int]:
    return dist.get_process_group_ranks(group)


def _check_same_shards(modules: list[_Module], control: dist.ProcessGroup, tp: TensorParallel) -> None:
    """Raise ValueError unless every process of the stage holds shards of the same shapes.

    The TP ranks must compress alike: the same groups of matrices draw the same Q from the
    same seed, so that a tensor held whole on every TP rank stays bit-identical, and the
    rank policy, which reads the shapes, decides alike. One all-reduce at registration
    (MAX of the shapes' checksum and of its negation: 16 bytes), none in the steps."""
    shapes = [shape for m in modules for _, shape in m.entries]
    checksum = zlib.crc32(repr(shapes).encode())
    device = modules[0].group.params[0].tensor.device
    both = torch.tensor([checksum, -checksum], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=control)
    if int(both[0]) != checksum or int(both[1]) != -checksum:
        raise ValueError(f"the {tp.size} TP ranks hold shards of different shapes (uneven splits); EDGC compresses "
                         "every TP rank alike and needs equal shards: make the split dimensions (heads, widths) "
                         f"divisible by {tp.size}")


def _fsdp_modules(model: nn.Module, shard_ranks: list[int], shard_dim: str, expert_group: Any = None
                  ) -> tuple[list[Any], list[_Module]]:
    """The FSDPModules of `model` that own parameters, and each one's layout (`_Module`);
    those sharded on `expert_group` (the expert mesh's shard group) are the experts', with
    entries numbered apart from the dense ones. Raises ValueError for a module
    register_edgc cannot serve: several parameter groups, native HSDP on the 2-D mesh,
    another shard mesh, a parameter sharded on a dim other than 0."""
    from torch.distributed.fsdp import FSDPModule  # (torch >= 2.6)

    fsdp_modules = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not fsdp_modules:
        raise ValueError("register_edgc found no FSDPModule in the model: shard it with "
                         f"fully_shard(module, mesh=mesh[{shard_dim!r}]) first")
    # One unit per FSDP state: fully_shard([a, b]) makes a and b FSDPModules that share
    # one state, one parameter group and one hook (a final norm and the output layer, or
    # tied embeddings, as torchtitan shards them). It is hooked once, named "a+b".
    units: dict[int, tuple[str, Any]] = {}
    for name, m in fsdp_modules:
        key = id(fsdp_state(m))
        label = name or "<root>"
        units[key] = (f"{units[key][0]}+{label}", units[key][1]) if key in units else (label, m)
    hooked: list[Any] = []  # the FSDPModules of `modules`, in its order
    modules: list[_Module] = []
    for label, m in units.values():
        groups = module_params(m)
        if len(groups) > 1:
            raise ValueError(f"FSDPModule {label!r} has {len(groups)} parameter groups (a per-parameter mesh); "
                             "register_edgc needs one group per module")
        if not groups:
            continue  # (no parameters of its own: FSDP calls no hook for it)
        group = groups[0]
        if group.native_hsdp:
            raise ValueError(f"FSDPModule {label!r} is sharded on the 2-D mesh (native HSDP), whose own all-reduce "
                             "would run as well and double the traffic; shard it with "
                             f"fully_shard(module, mesh=mesh[{shard_dim!r}])")
        sharded_over = _ranks(group.shard_group)
        if sharded_over != shard_ranks:
            raise ValueError(f"FSDPModule {label!r} is sharded over ranks {sharded_over}, "
                             f"not over mesh[{shard_dim!r}] ({shard_ranks})")
        expert = expert_group is not None and group.shard_group is expert_group
        index = sum(other.expert == expert for other in modules)  # (each core numbers its own modules)
        for param in group.params:
            if param.dim != 0:
                raise ValueError(f"parameter {param.name!r} is sharded on dim {param.dim}; "
                                 "register_edgc needs dim-0 shards (the default)")
        entries: list[Entry] = []
        for k, param in enumerate(group.params):
            shape = tuple(param.padded_shape)
            if expert and len(shape) >= 2:  # (stacked experts [E', ...]: E' tensors, a batch of matrices)
                entries += [((index, k, e), shape[1:]) for e in range(shape[0])]
            else:
                entries.append(((index, k), shape))
        modules.append(_Module(label, group, entries, sum(math.prod(shape) for _, shape in entries), expert=expert))
        hooked.append(m)
    return hooked, modules


def _expert_groups(expert_mesh: DeviceMesh, shard_mesh: DeviceMesh, replicate_dim: str, shard_dim: str
                   ) -> tuple[DeviceMesh, DeviceMesh, int]:
    """The expert mesh's replicate and shard slices and its EP size; raises ValueError
    unless it is (replicate, "ep", shard) with the dense mesh's shard groups (edgc.moe.expert_mesh)."""
    names = tuple(expert_mesh.mesh_dim_names or ())
    if names != (replicate_dim, "ep", shard_dim):
        raise ValueError(f"register_edgc's expert_mesh must have the dimensions ({replicate_dim!r}, 'ep', "
                         f"{shard_dim!r}) (edgc.moe.expert_mesh builds it); got {names or None}")
    e_shard = expert_mesh[shard_dim]
    if _ranks(e_shard.get_group()) != _ranks(shard_mesh.get_group()):
        raise ValueError(f"the expert mesh's {shard_dim!r} groups must be the dense mesh's "
                         f"({_ranks(shard_mesh.get_group())}); this process's is {_ranks(e_shard.get_group())}")
    return expert_mesh[replicate_dim], e_shard, expert_mesh["ep"].size()


def register_edgc(model: nn.Module, mesh: DeviceMesh, config: EDGCConfig | None = None, *,
                  replicate_dim: str = "replicate", shard_dim: str = "shard",
                  expert_mesh: DeviceMesh | None = None,
                  expert_config: EDGCConfig | None = None, reduce: str = "mean") -> EDGCFSDPState:
    """Hook EDGC into every FSDPModule of `model`, sharded with
    `fully_shard(module, mesh=mesh[shard_dim])`; returns the state (stats, checkpoints).

    Gradients are averaged across `mesh[replicate_dim]`, compressed after the warm-up;
    the rank is agreed over the whole mesh. Call it once, after fully_shard and before the
    first backward pass, on every process of the mesh (it creates a process group when
    the mesh is not the whole world). Raises ValueError on a layout it cannot serve (see
    the module doc).

    Mixture of experts (edgc.moe): with `expert_mesh` (edgc.moe.expert_mesh(mesh, ep)),
    the FSDPModules sharded on `expert_mesh[shard_dim]` are the experts'. A parameter of
    theirs stacked on a leading expert dimension, [E', out, in], is compressed as E'
    matrices of (out, in), one batch (E' vectors for [E', out]). Their gradients
    are averaged over `expert_mesh[replicate_dim]`, the processes holding the same
    experts, by a compression core of their own (own error feedback, Q, rank and
    signals, agreed over the processes of the same EP rank); their FSDP divide factor is
    set to shards x ep, so that every gradient ends divided by the whole data-parallel
    degree. `expert_stats()` gives their counters. `expert_config`: the experts' core's
    own settings (their policy, rank range, warm-up, wire), where they should differ from
    `config`'s; None: `config`'s.

    `reduce`: how the replicas' gradients combine, "mean" (as native HSDP with FSDP's
    default divide factor) or "sum" (as native HSDP after
    `set_gradient_divide_factor(1.0)`, for a trainer that divides its loss by the global
    token count, as torchtitan does): the average is compressed and sent, then multiplied
    by the number of replicas. FSDP's reduce-scatter within a replica follows the
    module's own divide factor either way.
    """
    if reduce not in ("mean", "sum"):
        raise ValueError(f'register_edgc: reduce={reduce!r} must be "mean" or "sum"')
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("register_edgc needs torch.distributed initialised (init_process_group or torchrun)")
    replicate_mesh, shard_mesh = _mesh_groups(mesh, replicate_dim, shard_dim)
    if expert_config is not None and expert_mesh is None:
        raise ValueError("register_edgc was given an expert_config but no expert_mesh: the experts' settings "
                         "apply to the FSDPModules sharded on expert_mesh (edgc.moe.expert_mesh)")
    if reduce == "sum" and expert_mesh is not None:
        raise ValueError('register_edgc: reduce="sum" is not built for experts (expert_mesh), whose divide factor '
                         "edgc sets to the whole data-parallel degree")
    experts = None if expert_mesh is None else _expert_groups(expert_mesh, shard_mesh, replicate_dim, shard_dim)
    hooked, modules = _fsdp_modules(model, _ranks(shard_mesh.get_group()), shard_dim,
                                    experts[1].get_group() if experts is not None else None)
    dense = [m for m in modules if not m.expert]
    tp = tensor_parallel(mesh, [m.group for m in dense], replicate_dim, shard_dim)
    control = stage_group(mesh, (replicate_dim, shard_dim, *tp.dims), tp.ranks)
    if tp.size > 1:
        if experts is not None:
            raise ValueError("register_edgc does not combine experts (expert_mesh) with tensor parallelism yet")
        _check_same_shards(modules, control, tp)
    # (the core checks the config: its type, its values, and that max_rank is set)
    sync = GradientSync(replicate_mesh.get_group(), config, control_group=control, eager=True)
    sync.declare([m.entries for m in dense], [m.group.reduce_dtype for m in dense], uncounted=tp.copies)
    expert_sync, ep = None, 1
    if experts is not None:
        assert expert_mesh is not None
        e_replicate, _, ep = experts
        mine = [m for m in modules if m.expert]
        if not mine:
            raise ValueError(f"register_edgc was given an expert_mesh, but no FSDPModule is sharded on "
                             f"expert_mesh[{shard_dim!r}]: fully_shard(block.mlp.experts, "
                             f"mesh=expert_mesh[{shard_dim!r}]) before the blocks")
        expert_sync = GradientSync(e_replicate.get_group(), config if expert_config is None else expert_config,
                                   eager=True,
                                   control_group=stage_group(expert_mesh, (replicate_dim, shard_dim)))
        expert_sync.declare([m.entries for m in mine], [m.group.reduce_dtype for m in mine])
        gloo = dist.get_backend(shard_mesh.get_group()) == "gloo"
        for m, module in zip(hooked, modules, strict=True):
            if module.expert:  # (the expert all-reduce spans replicas / ep: see edgc.moe)
                m.set_gradient_divide_factor(float(shard_mesh.size() * ep))
                if gloo and shard_mesh.size() > 1:  # (gloo has no pre-multiplied sum: sum, then divide)
                    m.set_force_sum_reduction_for_comms(True)
    state = EDGCFSDPState(modules, sync, (replicate_mesh.size(), shard_mesh.size(), tp.size), expert_sync, ep,
                          reduce)
    for index, m in enumerate(hooked):
        m.set_all_reduce_hook(functools.partial(state._hook, index))
    logger.info("EDGC on FSDP: %s modules hooked, %s replicas x %s shards x %s TP ranks, %s EP ranks", len(modules),
                *state.layout, ep)
    return state

