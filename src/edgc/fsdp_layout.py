"""How edgc.fsdp reads a model's layout off its meshes: the tensor-parallel dimensions its
FSDP parameters are split over (`tensor_parallel`), and the group of processes that agree
the compression's decisions (`stage_group`: a pipeline stage's replicas x shards x TP
ranks), also where the meshes were unflattened from a 1-D world mesh (torchtitan's)."""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from edgc.fsdp_internals import ModuleParams, root_mesh

__all__ = ["TensorParallel", "stage_group", "tensor_parallel"]


@dataclass(frozen=True)
class TensorParallel:
    """What tensor parallelism does to a model's FSDP parameters, seen from this process."""

    dims: tuple[str, ...]  # the mesh dimensions the parameters are split over besides the shard one ("tp")
    size: int  # TP ranks (the product of those dimensions' sizes; 1 without TP)
    copies: frozenset[Hashable]  # entry keys of tensors held whole on every TP rank, counted on another one
    ranks: tuple[int, ...] = ()  # this process's TP group, where `mesh`'s root mesh lacks `dims` (else ())


def tensor_parallel(mesh: DeviceMesh, groups: list[ModuleParams], replicate_dim: str, shard_dim: str
                    ) -> TensorParallel:
    """Read the TP layout off the parameters FSDP holds: a parameter that
    `parallelize_module` split is a DTensor on a (shard, tp) mesh. A tensor TP leaves whole
    (outside the plan, or Replicate on the TP dimension) is a copy on every TP rank; it is
    counted in the signals by the TP rank whose coordinate is 0 on every dimension it is
    not split over. The TP dimensions are read off `mesh`'s root mesh, or where it lacks
    them (meshes unflattened from a 1-D world mesh, as torchtitan builds them) off a split
    parameter's own mesh, with this process's TP group (`ranks`). Raises ValueError when
    the replicate dimension splits a parameter, or no one mesh holds every TP dimension."""
    dims: list[str] = []
    for group in groups:
        for param in group.params:
            for name in param.tensor.device_mesh.mesh_dim_names or ():
                if name != shard_dim and name not in dims:
                    dims.append(name)
    if not dims:
        return TensorParallel((), 1, frozenset())
    if replicate_dim in dims:
        raise ValueError(f"the model's parameters are split over mesh dimensions {dims}, the replicate dimension "
                         f"{replicate_dim!r} among them: register_edgc syncs the replicas, which must hold whole "
                         "copies of each shard")
    root = root_mesh(mesh)
    ranks: tuple[int, ...] = ()
    if not set(dims) <= set(root.mesh_dim_names or ()):
        # (a mesh unflattened from the world mesh, as torchtitan builds: its root is "world",
        # so the TP dimensions are read off a split parameter's own mesh)
        root = next((p.tensor.device_mesh for g in groups for p in g.params
                     if set(dims) <= set(p.tensor.device_mesh.mesh_dim_names or ())), None)
        if root is None:
            raise ValueError(f"the model's parameters are split over mesh dimensions {dims}, which no one mesh "
                             "holds (neither the mesh given to register_edgc's root nor a parameter's): build one "
                             f"mesh ({replicate_dim!r}, {shard_dim!r}, 'tp') and pass mesh[{replicate_dim!r}, "
                             f"{shard_dim!r}]")
        ranks = tuple(sorted(int(r) for r in root[tuple(dims)].mesh.flatten().tolist()))
    coordinate = {d: root[d].get_local_rank() for d in dims}
    copies = set()
    for index, group in enumerate(groups):
        for k, param in enumerate(group.params):
            names = tuple(param.tensor.device_mesh.mesh_dim_names or ())
            split = {n for n, placement in zip(names, param.tensor.placements, strict=True)
                     if n != shard_dim and not placement.is_replicate()}
            if any(coordinate[d] != 0 for d in dims if d not in split):
                copies.add((index, k))
    return TensorParallel(tuple(dims), math.prod(root[d].size() for d in dims), frozenset(copies), ranks)


def stage_group(mesh: DeviceMesh, stage_dims: tuple[str, ...], tp_ranks: tuple[int, ...] = ()
                 ) -> dist.ProcessGroup:
    """The group that agrees the decisions: every process that shares this one's
    coordinates on the root mesh's other dimensions (a pipeline stage's "pp"), over the
    `stage_dims`. Every process creates every such group, in the same order
    (torch.distributed.new_subgroups_by_enumeration), as new_group requires.
    `tp_ranks`: this process's TP group where the root mesh lacks the TP dimensions; the
    stage is then `mesh`'s processes and their TP groups (`_joined_stages`)."""
    if tp_ranks:
        return _subgroup(_joined_stages(mesh, tp_ranks))
    root = root_mesh(mesh)
    names = tuple(root.mesh_dim_names or ())
    if not set(stage_dims) <= set(names):  # (a mesh of its own, not sliced: it is the stage)
        names, root = tuple(mesh.mesh_dim_names or ()), mesh
    other = [i for i, n in enumerate(names) if n not in stage_dims]
    inner = [names.index(n) for n in stage_dims]
    ranks = root.mesh.permute(*other, *inner).reshape(-1, math.prod(root.mesh.shape[i] for i in inner))
    return _subgroup([sorted(row.tolist()) for row in ranks])


def _subgroup(stages: list[list[int]]) -> dist.ProcessGroup:
    """This process's group among `stages` (every process names them all, in one order)."""
    if len(stages) == 1 and len(stages[0]) == dist.get_world_size():
        assert dist.group.WORLD is not None  # (initialised: register_edgc checked)
        return dist.group.WORLD
    group, _ = dist.new_subgroups_by_enumeration(stages)
    if group is None:
        raise ValueError(f"process {dist.get_rank()} is not in the mesh given to register_edgc")
    return group


def _joined_stages(mesh: DeviceMesh, tp_ranks: tuple[int, ...]) -> list[list[int]]:
    """Every stage: the processes linked by `mesh` (replicate x shard) or by a TP group,
    from every process's two groups (one all_gather_object at registration)."""
    mine = sorted({int(r) for r in mesh.mesh.flatten().tolist()} | set(tp_ranks))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    stages: list[set[int]] = []
    for ranks in everyone:  # (merge the groups that share a process)
        joined = set(ranks)
        for stage in [s for s in stages if s & joined]:
            joined |= stage
            stages.remove(stage)
        stages.append(joined)
    return sorted(sorted(stage) for stage in stages)
