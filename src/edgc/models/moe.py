"""Routed experts for the GPT-2 model: a mixture-of-experts MLP (edgc.models.gpt2 uses
it when `GPTConfig.n_expert` > 0).

Each token's hidden state goes to `top_k` of `n_expert` experts, chosen by a linear
router; their outputs are summed with the router's weights (renormalised over the k
chosen). An expert is GPT-2's MLP at a narrower width, `expert_width` (4C / k by default,
so a token's active MLP parameters match the dense block's). The experts' weights are
one parameter per kind, stacked on a leading expert dimension ([E, out, in]), so a batch
of experts is one tensor: one gradient, compressed as E matrices in one batch.

Load balancing: the Switch Transformer's auxiliary loss, E * sum_i f_i * P_i (f_i the
share of the step's assignments that went to expert i, P_i its mean router
probability), added to the training loss with `aux_loss_coef`. It needs nothing outside
autograd; the bias-only balancing of DeepSeek-V3 would add a buffer updated outside the
gradients, to be agreed over every replica and checkpointed.

There is no distributed code here. Where the experts are split over expert-parallel
ranks (edgc.moe.parallelize_experts), this module holds only its share of them
(`Experts.first` tells which) and `dispatch` is replaced by one that sends each token to
the rank holding its expert and back.

Shapes in comments: N tokens, C = n_embd, F = expert width, E experts (E' held here),
k = top_k, A = N * k assignments.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Experts", "MoE", "local_dispatch"]

# what a dispatch does: run the assignments (A, C), sorted by global expert, through the
# experts, given how many go to each global expert (E,); returns (A, C) in the same order
Dispatch = Callable[[torch.Tensor, torch.Tensor, "Experts"], torch.Tensor]


class Experts(nn.Module):
    """E' experts, each C -> F -> GELU -> C, as stacked weights: w_fc [E', F, C],
    b_fc [E', F], w_proj [E', C, F], b_proj [E', C]."""

    def __init__(self, n_expert: int, n_embd: int, width: int, bias: bool) -> None:
        super().__init__()
        self.first = 0  # the global index of expert 0 here (edgc.moe.parallelize_experts sets it)
        self.w_fc = nn.Parameter(torch.empty(n_expert, width, n_embd))
        self.w_proj = nn.Parameter(torch.empty(n_expert, n_embd, width))
        self.b_fc = nn.Parameter(torch.zeros(n_expert, width)) if bias else None
        self.b_proj = nn.Parameter(torch.zeros(n_expert, n_embd)) if bias else None
        for p in self.parameters():  # (edgc's DDP hook compresses a stacked weight as E' matrices)
            p._edgc_stacked_experts = True  # type: ignore[attr-defined]

    @property
    def count(self) -> int:
        """Experts held here (E')."""
        return self.w_fc.shape[0]

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x (M, C): rows sorted by local expert, counts[e] of them for expert e; returns
        (M, C). An expert given no rows still takes part (its gradient is zero), so every
        parameter has a gradient in every step, as DDP and FSDP want."""
        outs = []
        for e, rows in enumerate(x.split(counts)):
            h = rows @ self.w_fc[e].T  # (M_e, F)
            if self.b_fc is not None:
                h = h + self.b_fc[e]
            h = F.gelu(h, approximate="tanh") @ self.w_proj[e].T  # (M_e, C)
            if self.b_proj is not None:
                h = h + self.b_proj[e]
            outs.append(h)
        return torch.cat(outs)


def local_dispatch(routed: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
    """Every expert is here: run the sorted assignments through them."""
    return experts(routed, counts.tolist())


class MoE(nn.Module):
    """Top-k routed experts in place of a block's MLP. After a forward pass in training,
    `aux_loss` holds the load-balancing loss and `load` (E,) int64 counts the
    assignments each expert received since it was last reset (this replica's tokens)."""

    def __init__(self, n_embd: int, n_expert: int, top_k: int, width: int, bias: bool, dropout: float) -> None:
        super().__init__()
        self.top_k = top_k
        self.n_expert = n_expert
        self.router = nn.Linear(n_embd, n_expert, bias=False)
        self.experts = Experts(n_expert, n_embd, width, bias)
        self.dropout = nn.Dropout(dropout)
        self.dispatch: Dispatch = local_dispatch
        self.aux_loss: torch.Tensor | None = None
        self.load = torch.zeros(n_expert, dtype=torch.int64)

    def init_weights(self, std: float, proj_std: float) -> None:
        """GPT-2's init for the experts (the router is a Linear, initialised by the model)."""
        nn.init.normal_(self.experts.w_fc, mean=0.0, std=std)
        nn.init.normal_(self.experts.w_proj, mean=0.0, std=proj_std)
        for b in (self.experts.b_fc, self.experts.b_proj):
            if b is not None:
                nn.init.zeros_(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # (N, C)
        logits = self.router(tokens)  # (N, E)
        probs = logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(dim=-1)  # (at least float32)
        weights, ids = probs.topk(self.top_k, dim=-1)  # (N, k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        ids = ids.reshape(-1)  # (A,): assignment a is token a // k
        counts = torch.bincount(ids, minlength=self.n_expert)  # (E,)
        if self.training:
            share = counts.to(probs.dtype) / ids.numel()  # f_i
            self.aux_loss = self.n_expert * (share * probs.mean(dim=0)).sum()
            if self.load.device != counts.device:  # (built on another device, or on meta)
                self.load = torch.zeros_like(counts)
            self.load = self.load + counts.detach()
        order = ids.argsort(stable=True)  # (A,): assignments by expert, in token order within one
        out = self.dispatch(tokens[order // self.top_k], counts, self.experts)  # (A, C), sorted
        unsorted = torch.empty_like(out).index_copy_(0, order, out)  # (A, C) in assignment order
        y = (unsorted.view(-1, self.top_k, shape[-1]) * weights.unsqueeze(-1).to(out.dtype)).sum(dim=1)
        return self.dropout(y.view(shape))


def expert_width(n_embd: int, top_k: int, width: int | None) -> int:
    """An expert's hidden width: `width`, or 4C / k rounded up to a multiple of 8."""
    if width is not None:
        return width
    return 8 * math.ceil(4 * n_embd / top_k / 8)
