"""Tensor parallelism for edgc's GPT-2, with torch's own DTensor machinery (after torchtitan's
plan for its Llama models).

The plan, per transformer block, on the 1-D "tp" mesh of T ranks:

    attn.c_attn  ColwiseParallel   q, k and v of nh / T whole heads per rank
    attn.c_proj  RowwiseParallel   the heads' outputs summed over the TP ranks
    mlp.c_fc     ColwiseParallel   4C / T hidden units per rank
    mlp.c_proj   RowwiseParallel

The position embedding and the norms stay whole on every TP rank. The token embedding and
the head (tied to it: one Parameter) are split on the vocabulary (`vocab_parallel`, the
default; without it they stay whole on every rank), as Megatron and torchtitan split them:
the embedding row-wise (each rank looks up the tokens of its V / T rows, and the outputs
are summed over the TP ranks), the head column-wise (each rank computes the logits of its
V / T tokens, gathered whole for the loss), and the two re-tied to the one split
Parameter. With `sequence_parallel`, the norms and the residual stream between the blocks
are split on the sequence instead (torch's SequenceParallel): each rank holds T_seq / T
positions there, and the all-reduce at each row-parallel output becomes a reduce-scatter
plus an all-gather before the next column-parallel input.

Why c_attn's rows are reordered. GPT-2 computes q, k and v in one (3C x C) matrix whose
rows are [q; k; v]. ColwiseParallel gives each rank a contiguous block of 3C / T rows,
which for T = 2 would be all of q and half of k. `apply_tp` first reorders the rows to
[q_0; k_0; v_0; q_1; k_1; v_1; ...], where x_t are the rows of rank t's heads, so that each
rank's block is itself a fused [q; k; v] of its own heads; the attention reads its head
count off the shapes (edgc.models.gpt2). The same permutation is applied to the optimiser
state, and undone in checkpoints (`to_file_layout`), so a checkpoint holds the model as
one process would, whatever T it was trained with.

Gradients. Each TP rank holds the gradient of its own shards; the whole tensors' gradients
come out the same on every TP rank (the activations between the plan's boundaries are
replicated, and SequenceParallel's partial norm gradients are summed over TP by FSDP before
its hooks). edgc.fsdp compresses each rank's shards over its own replicate group.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from edgc.models.gpt2 import GPTConfig

__all__ = ["apply_tp", "check_tp", "qkv_order", "to_file_layout", "to_tp_layout"]

C_ATTN = "attn.c_attn."  # (the fused q, k, v projection's parameters end in "attn.c_attn.weight" / ".bias")


def check_tp(config: GPTConfig, tp: int) -> None:
    """Raise ValueError unless `config` splits evenly over `tp` ranks (whole heads, and a
    width the MLP's hidden layer divides into)."""
    if tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp}")
    if config.n_head % tp:
        raise ValueError(f"tensor parallelism splits whole attention heads: n_head({config.n_head}) % tp({tp}) = "
                         f"{config.n_head % tp}")
    if config.dropout:
        raise ValueError("tensor parallelism needs dropout 0: the TP ranks of a replica would drop different "
                         "elements of the activations they must agree on")


def qkv_order(n_embd: int, tp: int) -> torch.Tensor:
    """The row order that gives each of `tp` ranks a fused [q; k; v] of its own heads:
    row i of the reordered matrix is row order[i] of GPT-2's [q; k; v] (3 * n_embd rows)."""
    part = n_embd // tp
    return torch.cat([torch.arange(which * n_embd + t * part, which * n_embd + (t + 1) * part)
                      for t in range(tp) for which in range(3)])


def apply_tp(model: nn.Module, mesh: DeviceMesh, *, sequence_parallel: bool = False,
             vocab_parallel: bool = True) -> None:
    """Split the blocks of a GPT (or of a pipeline stage holding `h`) over the 1-D `mesh`,
    and with `vocab_parallel` its token embedding and head, in place (see the module doc).
    Call it on a freshly built model, before fully_shard."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp = mesh.size()
    blocks: Any = model.h
    for block in blocks:
        order = qkv_order(block.attn.n_embd, tp)
        with torch.no_grad():
            for p in block.attn.c_attn.parameters():
                p.copy_(p[order])
        plan: dict[str, Any] = {
            "attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel(),
        }
        if sequence_parallel:
            seq = Shard(1)
            gather = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                        use_local_output=True)
            plan.update({
                "ln_1": SequenceParallel(), "ln_2": SequenceParallel(), "attn": gather, "mlp": gather,
                "attn.c_proj": RowwiseParallel(output_layouts=seq), "mlp.c_proj": RowwiseParallel(output_layouts=seq),
            })
        parallelize_module(block, mesh, plan)
    if vocab_parallel:
        _split_vocabulary(model, mesh, sequence_parallel)
    if sequence_parallel:
        # into the blocks: the replicated embedding's output, cut on the sequence (no
        # communication); out of them: the final norm on the sequence's shards, then
        # gathered whole for the head
        first = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                   use_local_output=True)
        parallelize_module(blocks[0], mesh, first)
        if getattr(model, "ln_f", None) is not None:
            tail: dict[str, Any] = {"ln_f": SequenceParallel()}
            if not vocab_parallel:  # (a split head gathers its input itself: _split_vocabulary)
                tail["lm_head"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                     use_local_output=True)
            parallelize_module(model, mesh, tail)


def _split_vocabulary(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Split the token embedding row-wise and the head column-wise on the vocabulary (a
    pipeline stage has either or both), and tie the head to the split embedding again
    where the two were one Parameter. With `sequence_parallel` the head's input arrives
    split on the sequence (from the final norm) and is gathered whole first."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    wte, head = getattr(model, "wte", None), getattr(model, "lm_head", None)
    tied = wte is not None and head is not None and head.weight is wte.weight
    plan: dict[str, Any] = {}
    if wte is not None:
        plan["wte"] = RowwiseParallel(input_layouts=Replicate())  # (B, T) ids -> (B, T, C) summed over TP
    if head is not None:
        # (B, T, C) -> (B, T, V / tp) -> gathered (B, T, V)
        plan["lm_head"] = ColwiseParallel(input_layouts=Shard(1) if sequence_parallel else Replicate(),
                                          output_layouts=Replicate())
    parallelize_module(model, mesh, plan)
    if tied:
        model.lm_head.weight = model.wte.weight  # type: ignore[union-attr]


def _reorder(state: dict[str, Any], tp: int, n_embd: int, inverse: bool) -> dict[str, Any]:
    """`state` (a model's or an optimiser's full state dict, by parameter name) with the
    rows of every c_attn tensor reordered for `tp` ranks, or back with `inverse`."""
    order = qkv_order(n_embd, tp)
    if inverse:
        order = torch.argsort(order)

    def fix(name: str, value: Any) -> Any:
        if C_ATTN in name and isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == 3 * n_embd:
            return value[order]
        if isinstance(value, dict):  # (an optimiser's per-parameter state)
            return {k: fix(name, v) for k, v in value.items()}
        return value

    return {name: fix(name, value) for name, value in state.items()}


def to_file_layout(model_state: dict[str, Any], opt_state: dict[str, Any], tp: int,
                   n_embd: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Full model and optimiser state dicts (by parameter name, as
    torch.distributed.checkpoint.state_dict gives them) with c_attn's rows back in GPT-2's
    order; returns new dicts, the inputs are not changed. Empty dicts (the ranks that
    hold none) pass through."""
    return _states(model_state, opt_state, tp, n_embd, inverse=True)


def to_tp_layout(model_state: dict[str, Any], opt_state: dict[str, Any], tp: int,
                 n_embd: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The inverse of to_file_layout: a checkpoint's states reordered for `tp` ranks."""
    return _states(model_state, opt_state, tp, n_embd, inverse=False)


def _states(model_state: dict[str, Any], opt_state: dict[str, Any], tp: int, n_embd: int,
            inverse: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both states reordered (_reorder), the optimiser's per-parameter "state" only."""
    if tp == 1:
        return model_state, opt_state
    opt = dict(opt_state)
    if "state" in opt:
        opt["state"] = _reorder(opt["state"], tp, n_embd, inverse)
    return _reorder(model_state, tp, n_embd, inverse), opt
