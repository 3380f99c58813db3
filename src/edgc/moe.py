"""Expert parallelism for the mixture-of-experts GPT (edgc.models.moe), and what edgc needs
to compress the experts' gradients over their own replicas.

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from edgc.fsdp import register_edgc
    from edgc.moe import expert_mesh, parallelize_experts

    dense = init_device_mesh("cuda", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    sparse = expert_mesh(dense, ep)            # ("replicate", "ep", "shard"): the same ranks
    parallelize_experts(model, sparse["ep"])   # each EP rank keeps E / ep experts
    for block in model.h:
        fully_shard(block.mlp.experts, mesh=sparse["shard"])  # the experts: their own FSDP unit
        fully_shard(block, mesh=dense["shard"])
    fully_shard(model, mesh=dense["shard"])
    state = register_edgc(model, dense, config, expert_mesh=sparse)

The groups. The data-parallel world is replicas x shards processes, each with its own
tokens. The dense parameters are averaged over all of them: reduce-scattered over the
shard group by FSDP, then all-reduced (compressed) over the dense replicate group. The
experts are split over `ep` consecutive replicas (the EP group, one per shard position);
a token reaches the rank holding its expert through an all-to-all and comes back through
another, and the backward pass does the same with the gradients. An expert's gradient on
one rank then already holds every token its EP group routed to it, so its replicas are
the ranks holding the same experts: the shard group (reduce-scatter, FSDP) and the
expert replicate group, replicas / ep processes. edgc compresses that all-reduce over
the expert replicate group, with a state, a rank and rank signals of its own, as it
compresses the dense one over the dense replicate group.

Scaling. Each process's loss is the mean over its own tokens, so every gradient must end
divided by the whole data-parallel degree, replicas x shards. FSDP divides by the shard
size and the dense all-reduce by the replicas; the experts' all-reduce spans only
replicas / ep processes, so register_edgc sets the expert FSDP units' divide factor to
shards x ep (FSDPModule.set_gradient_divide_factor, applied inside the reduce-scatter).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from edgc.comm.wire import BLOCK, codec, dequantize, quantize, wire_bytes
from edgc.config import EP_WIRES
from edgc.models.moe import Experts, MoE

__all__ = ["EP_WIRES", "ExpertParallel", "busiest_share", "expert_mesh", "expert_parameter_names", "load_counts",
           "moe_layers", "parallelize_experts", "to_expert_file_layout", "to_expert_local_layout"]


class ExpertParallel:
    """The dispatch of MoE layers whose experts are split over the ranks of `group`: each
    assignment goes to the rank holding its expert (all-to-all, uneven splits), through
    the experts there, and back (all-to-all with the splits swapped); both are
    differentiable, and the backward pass sends the gradients the same way.

    `wire` "int8" sends the hidden states and their gradients as edgc's int8 wire does
    the gradient (edgc.comm.wire: a byte a value and a bfloat16 scale a block of 32, each
    row its own blocks; the width must be a multiple of 32); "native" as they are.

    `bytes_sent` counts the bytes this process handed to the all-to-alls for other ranks
    (rows to itself are a local copy, not counted): the forward dispatch and combine,
    the same again in the backward pass when gradients are wanted, and the count
    exchange; `reset()` returns and zeroes it."""

    def __init__(self, group: dist.ProcessGroup, wire: str = "native") -> None:
        if wire not in EP_WIRES:
            raise ValueError(f"the experts' all-to-all wire must be one of {EP_WIRES}, got {wire!r}")
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.wire = wire
        self.bytes_sent = 0

    def reset(self) -> int:
        sent, self.bytes_sent = self.bytes_sent, 0
        return sent

    def _all_to_all(self, x: torch.Tensor, recv: list[int], send: list[int]) -> torch.Tensor:
        if self.wire == "int8":
            return _QuantizedAllToAll.apply(x, recv, send, self.group)
        from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

        return wait_tensor(all_to_all_single_autograd(x, recv, send, self.group))

    def __call__(self, routed: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
        ep, local = self.size, experts.count
        if self.wire == "int8" and routed.shape[-1] % BLOCK:
            raise ValueError(f"the int8 all-to-all needs a width that is a multiple of {BLOCK}, "
                             f"got {routed.shape[-1]}")
        # collective: all-to-all of the E assignment counts (E int64): rank j receives every
        # rank's counts for the experts it holds, (ep, E')
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        host = torch.cat([counts.view(ep, local).sum(dim=1), received]).tolist()  # (one host read)
        send, by_source = host[:ep], torch.tensor(host[ep:]).view(ep, local)  # rows to each rank; [i, e]
        recv = by_source.sum(dim=1).tolist()  # rows from each rank
        # collective: all-to-all of the assignments' hidden states (rows of C), uneven splits
        x = self._all_to_all(routed, recv, send)  # rank-major: (i, e) blocks
        order = _expert_major(by_source).to(x.device)
        y = experts(x[order], by_source.sum(dim=0).tolist())  # sorted by local expert
        back = torch.empty_like(y).index_copy_(0, order, y)  # rank-major again
        # collective: all-to-all of the experts' outputs back to their tokens (splits swapped)
        out = self._all_to_all(back, send, recv)
        row = wire_bytes(routed.shape[-1], routed.element_size(), self.wire)  # (one row, in the wire)
        others = (sum(send) - send[self.rank]) + (sum(recv) - recv[self.rank])  # dispatch + combine
        passes = 2 if torch.is_grad_enabled() and routed.requires_grad else 1
        self.bytes_sent += others * row * passes + (ep - 1) * local * counts.element_size()
        return out


def _quantized_all_to_all(x: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup
                          ) -> torch.Tensor:
    """Rows of x (M, C) sent as int8 codes with a bfloat16 scale a block of 32 (each row its
    own blocks, packed with its scales), `send[j]` rows to rank j; the received rows,
    dequantized into x's dtype."""
    code = codec("int8")
    assert code is not None
    rows, width = x.shape
    packed = quantize(x.detach().reshape(-1), code)  # (codes of every row, then every block's scale)
    per_row = torch.cat([packed[: rows * width].view(rows, width),
                         packed[rows * width:].view(rows, -1)], dim=1)  # (M, row bytes)
    got = torch.empty((sum(recv), per_row.shape[1]), dtype=torch.uint8, device=x.device)
    # collective: all-to-all of the packed rows (uint8), uneven splits
    dist.all_to_all_single(got, per_row, output_split_sizes=recv, input_split_sizes=send, group=group)
    n = got.shape[0] * width
    flat = torch.cat([got[:, :width].reshape(-1), got[:, width:].reshape(-1)])
    return dequantize(flat, n, code, x.dtype).view(-1, width)


class _QuantizedAllToAll(torch.autograd.Function):
    """The int8 all-to-all, and in the backward pass the gradients back the same way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup
                ) -> torch.Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        return _quantized_all_to_all(x, recv, send, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _quantized_all_to_all(grad.contiguous(), ctx.send, ctx.recv, ctx.group), None, None, None


def _expert_major(by_source: torch.Tensor) -> torch.Tensor:
    """The order that takes rows laid out by source rank then expert ((i, e) blocks of
    by_source[i, e] rows) to expert then source rank."""
    lens = by_source.reshape(-1)
    starts = torch.cumsum(lens, 0) - lens  # where block (i, e) starts
    t_lens = by_source.T.reshape(-1)  # blocks in (e, i) order
    t_starts = starts.view(by_source.shape).T.reshape(-1)
    first_out = torch.cumsum(t_lens, 0) - t_lens  # where block (e, i) goes
    return torch.repeat_interleave(t_starts - first_out, t_lens) + torch.arange(int(lens.sum()))


def moe_layers(model: nn.Module) -> Iterator[tuple[str, MoE]]:
    """The model's MoE layers, with their names."""
    for name, m in model.named_modules():
        if isinstance(m, MoE):
            yield name, m


def expert_parameter_names(model: nn.Module) -> list[str]:
    """The names of the experts' parameters (those split over EP ranks)."""
    return [f"{name}.experts.{p}" for name, m in moe_layers(model) for p, _ in m.experts.named_parameters()]


def expert_mesh(dense: DeviceMesh, ep: int, *, replicate_dim: str = "replicate",
                shard_dim: str = "shard") -> DeviceMesh:
    """The mesh of the experts for a dense ("replicate", "shard") mesh of R x S processes:
    ("replicate", "ep", "shard") of (R / ep) x ep x S over the same processes, in the same
    order (a dense replica r is the expert replica r // ep, EP rank r % ep). Its "shard"
    groups are the dense ones; its "replicate" groups hold the same experts. Raises
    ValueError unless ep divides R."""
    from torch.distributed.device_mesh import init_device_mesh

    names = tuple(dense.mesh_dim_names or ())
    if dense.ndim != 2 or names != (replicate_dim, shard_dim):
        raise ValueError(f"expert_mesh needs the dense 2-D mesh ({replicate_dim!r}, {shard_dim!r}); got dimensions "
                         f"{names or None}")
    replicas, shards = dense.shape
    if ep < 1 or replicas % ep:
        raise ValueError(f"the expert-parallel size ({ep}) must divide the {replicas} replicas of the dense mesh")
    if dense.mesh.flatten().tolist() != list(range(dist.get_world_size())):
        raise ValueError("expert_mesh needs a dense mesh over the whole world, in rank order (init_device_mesh)")
    return init_device_mesh(dense.device_type, (replicas // ep, ep, shards),
                            mesh_dim_names=(replicate_dim, "ep", shard_dim))


def parallelize_experts(model: nn.Module, ep_mesh: DeviceMesh | dist.ProcessGroup, *,
                        wire: str = "native") -> ExpertParallel:
    """Split every MoE layer's experts over the EP group (a 1-D mesh, e.g. expert_mesh(...)
    ["ep"], or a process group): EP rank j keeps experts j * E/ep to (j + 1) * E/ep - 1 of
    the weights built (so a model built with one seed everywhere splits into the same
    experts as a one-process run), and its tokens travel by all-to-all. Call it before
    fully_shard. `wire`: the format the tokens travel in (ExpertParallel). Returns the
    dispatch (its `bytes_sent`). Raises ValueError on a model without MoE layers, or an
    expert count ep does not divide."""
    group = ep_mesh.get_group() if isinstance(ep_mesh, DeviceMesh) else ep_mesh
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    layers = list(moe_layers(model))
    if not layers:
        raise ValueError("parallelize_experts found no MoE layer in the model (GPTConfig.n_expert = 0?)")
    dispatch = ExpertParallel(group, wire)
    for name, moe in layers:
        experts = moe.experts
        if experts.first or experts.count != moe.n_expert:
            raise ValueError(f"the experts of {name!r} are split already")
        if moe.n_expert % ep:
            raise ValueError(f"{name!r} has {moe.n_expert} experts, which {ep} EP ranks cannot split evenly")
        share = moe.n_expert // ep
        for pname, p in list(experts.named_parameters(recurse=False)):
            split = nn.Parameter(p.detach()[rank * share:(rank + 1) * share].clone(), requires_grad=p.requires_grad)
            split._edgc_expert_parallel = True  # type: ignore[attr-defined]  # (DDP's edgc hook refuses these)
            split._edgc_stacked_experts = True  # type: ignore[attr-defined]
            setattr(experts, pname, split)
        experts.first = rank * share
        moe.dispatch = dispatch
    return dispatch


def _map_experts(model_state: dict[str, Any], optim_state: dict[str, Any], names: list[str],
                 fn: Callable[[torch.Tensor], torch.Tensor]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model and optimiser states with `fn` applied to each expert tensor (its weights,
    and its optimiser state's tensors other than scalars), in the states' own order (the same
    on every rank: `fn` may be a collective)."""
    model_out = {k: fn(v) if k in names else v for k, v in model_state.items()}
    state = dict(optim_state.get("state", {}))
    for k in names:
        if k in state:
            state[k] = {s: fn(v) if isinstance(v, torch.Tensor) and v.dim() > 0 else v for s, v in state[k].items()}
    return model_out, {**optim_state, "state": state}


def to_expert_file_layout(model_state: dict[str, Any], optim_state: dict[str, Any], names: list[str],
                          group: dist.ProcessGroup) -> tuple[dict[str, Any], dict[str, Any]]:
    """Full model and optimiser states (torch.distributed.checkpoint's, keyed by parameter
    name, with every rank's own experts) with each expert tensor made whole over the EP
    group: [E', ...] from each EP rank concatenated into [E, ...], as a one-process run
    holds them. Collectives over `group`; every rank gets the result."""
    ep = dist.get_world_size(group)

    def whole(t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(ep)]
        # collective: all-gather of one expert tensor over the EP group
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts)

    return _map_experts(model_state, optim_state, names, whole)


def to_expert_local_layout(model_state: dict[str, Any], optim_state: dict[str, Any], names: list[str],
                           group: dist.ProcessGroup) -> tuple[dict[str, Any], dict[str, Any]]:
    """The inverse of to_expert_file_layout: each expert tensor [E, ...] cut to this EP
    rank's experts."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)

    def mine(t: torch.Tensor) -> torch.Tensor:
        share = t.shape[0] // ep
        return t[rank * share:(rank + 1) * share].clone()

    return _map_experts(model_state, optim_state, names, mine)


def load_counts(model: nn.Module) -> torch.Tensor | None:
    """The assignments each global expert received since the last call, summed over the
    model's MoE layers ((E,) int64, this process's tokens), and zeroed; None without MoE."""
    total = None
    for _, moe in moe_layers(model):
        total = moe.load.clone() if total is None else total + moe.load.to(total.device)
        moe.load = torch.zeros_like(moe.load)
    return total


def busiest_share(load: torch.Tensor) -> float:
    """The busiest expert's share of all assignments (1/E when balanced)."""
    n = int(load.sum())
    return float(load.max()) / n if n else math.nan
