"""torch's private FSDP2 internals that edgc.fsdp reads: every such access is in this module.

FSDP2 (`fully_shard`) hands an all-reduce hook each module's reduce-scatter output, but says
nowhere in its public API how that buffer is laid out, which mesh a module is sharded over,
what dtype it reduces in, or whether this micro-batch syncs. edgc.fsdp reads those from the
module's FSDP state (`FSDPModule._get_fsdp_state()`: its parameter group(s), each parameter's
padded shard size and placement, the mixed-precision policy) and from a sliced
DeviceMesh's root. They were checked against torch `CHECKED_TORCH`; on a release that lays
them out otherwise, each read raises RuntimeError naming the torch version and what was
missing, at `register_edgc`, rather than an AttributeError in the middle of a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CHECKED_TORCH", "ModuleParams", "ShardedParam", "fsdp_state", "module_params", "root_mesh"]

#: The torch releases whose FSDP2 internals this module was checked against.
CHECKED_TORCH = ("2.11", "2.13")


@dataclass(frozen=True)
class ShardedParam:
    """One parameter of an FSDPModule, as its reduce-scatter output holds it."""

    name: str  # its name in the model
    dim: int  # the dimension FSDP shards it on
    padded_shape: tuple[int, ...]  # its shard in the buffer: dim 0 padded to ceil(dim0 / shards) rows
    tensor: Any  # the sharded parameter (a DTensor: its device_mesh, placements, device, dtype)


@dataclass
class ModuleParams:
    """One parameter group of an FSDPModule: what the hook's buffer holds and how it syncs."""

    group: Any  # torch's FSDPParamGroup, private: read through the properties below only
    params: list[ShardedParam]  # in buffer order
    native_hsdp: bool  # sharded on a 2-D mesh, whose own all-reduce FSDP runs
    shard_group: Any  # the process group the parameters are sharded over (None: native HSDP)
    reduce_dtype: torch.dtype  # the dtype FSDP reduces the gradient in

    @property
    def all_reduce_grads(self) -> bool:
        """Whether this backward syncs (False after `set_requires_all_reduce(False)`)."""
        return bool(_read(lambda: self.group.all_reduce_grads, "FSDPParamGroup.all_reduce_grads"))


def fsdp_state(module: Any) -> Any:
    """An FSDPModule's FSDP state: one object for all the modules that one
    `fully_shard([a, b])` call sharded together, which share its parameter group and hook."""
    return _read(module._get_fsdp_state, "FSDPModule._get_fsdp_state")


def module_params(module: Any) -> list[ModuleParams]:
    """An FSDPModule's parameter groups: none (no parameters of its own), one, or several
    (a per-parameter mesh). Raises RuntimeError where this torch lays them out otherwise."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo

    state = fsdp_state(module)
    groups = getattr(state, "_fsdp_param_groups", None)  # (a list in torch 2.13)
    if groups is None:  # (one group or None in torch 2.11)
        group = _read(lambda: state._fsdp_param_group, "FSDPState._fsdp_param_group(s)")
        groups = [] if group is None else [group]
    mp = _read(lambda: state._mp_policy, "FSDPState._mp_policy")
    out = []
    for group in groups:
        params = [ShardedParam(_read(lambda fp=fp: fp._param_fqn, "FSDPParam._param_fqn"),
                               int(_read(lambda fp=fp: fp.fsdp_placement.dim, "FSDPParam.fsdp_placement")),
                               tuple(int(x) for x in _read(lambda fp=fp: fp.padded_sharded_param_size,
                                                           "FSDPParam.padded_sharded_param_size")),
                               _read(lambda fp=fp: fp.sharded_param, "FSDPParam.sharded_param"))
                  for fp in _read(lambda g=group: g.fsdp_params, "FSDPParamGroup.fsdp_params")]
        mesh_info = _read(lambda g=group: g.mesh_info, "FSDPParamGroup.mesh_info")
        reduce = mp.reduce_dtype or (params[0].tensor.dtype if params else torch.float32)
        native = isinstance(mesh_info, DDPMeshInfo)
        out.append(ModuleParams(group, params, native, None if native else mesh_info.mesh.get_group(), reduce))
    return out


def root_mesh(mesh: Any) -> Any:
    """The mesh `mesh` was sliced from (itself when it was not), which torch keeps
    privately (DeviceMesh._get_root_mesh)."""
    get_root = getattr(mesh, "_get_root_mesh", None)
    return get_root() if get_root is not None else mesh


def _read(get: Any, what: str) -> Any:
    """get(), with an AttributeError turned into a RuntimeError that names `what` and the
    torch releases this module was checked against."""
    try:
        return get()
    except AttributeError as exc:
        raise RuntimeError(f"edgc.fsdp reads {what}, an FSDP2 internal checked with torch "
                           f"{' and '.join(CHECKED_TORCH)}; torch {torch.__version__} has it otherwise ({exc}). "
                           "Use one of those releases, or the DDP hook") from None
