"""Which gradient each GPU of a tensor- and pipeline-parallel layout all-reduces over its DP group.

`stage_gradients` splits a model's real parameter shapes (the model may live on the meta
device) the way edgc's own tensor parallelism lays them out (edgc.train.tensor_parallel:
the token embedding split on the vocabulary, as Megatron splits it, or whole on every TP
rank; with pipelines the head's copy on the last stage), one `StageGradients` per pipeline
stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from edgc.models.gpt2 import GPT

__all__ = ["LAYOUTS", "StageGradients", "stage_gradients"]

#: The tensor-parallel layouts `stage_gradients` knows: what `edgc train --tp` syncs by
#: default ("vocab") and with --no-vocab-parallel ("whole"), and the vocabulary split
#: with the head's copy left out ("megatron", the layout of the 2026-11-22 projections).
LAYOUTS = ("vocab", "whole", "megatron")


@dataclass(frozen=True)
class StageGradients:
    """The gradient one GPU of pipeline stage `stage` all-reduces over its DP group."""

    stage: int
    shapes: tuple[tuple[int, ...], ...]
    """Shapes of the tensors of this GPU's (stage, tensor-parallel rank) shard."""

    @property
    def numel(self) -> int:
        """Elements of the shard: the sum of its tensors' sizes."""
        return sum(math.prod(s) for s in self.shapes)


# Megatron's split dimension of each block parameter, by name suffix, for nn.Linear's
# (out_features, in_features) weights: column-parallel layers (qkv, fc) split the output
# dimension and their bias with it; row-parallel layers (attn proj, mlp proj) split the
# input dimension and keep their bias whole. LayerNorms are replicated.
_TP_SPLIT = {
    "attn.c_attn.weight": 0,
    "attn.c_attn.bias": 0,
    "mlp.c_fc.weight": 0,
    "mlp.c_fc.bias": 0,
    "attn.c_proj.weight": 1,
    "mlp.c_proj.weight": 1,
}
_REPLICATED = ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "attn.c_proj.bias", "mlp.c_proj.bias")


def _shard(shape: torch.Size, dim: int | None, tp: int) -> tuple[int, ...]:
    """`shape` with dimension `dim` divided by tp (rounded up); unchanged when dim is None."""
    out = [int(d) for d in shape]
    if dim is not None:
        out[dim] = -(-out[dim] // tp)
    return tuple(out)


def stage_gradients(model: GPT, tp: int, pp: int, layout: str = "vocab") -> list[StageGradients]:
    """Return, per pipeline stage, the gradient shapes one GPU of that stage synchronises.

    The model's real parameters (`model` may live on the meta device), laid out as:

    - blocks split evenly over the pp stages (the first n_layer % pp stages get one
      more); stage 0 also holds wte and wpe, the last stage ln_f;
    - qkv and fc column-parallel (output dimension and bias split), attn proj and mlp
      proj row-parallel (input dimension split, bias replicated); wpe and LayerNorms
      replicated;
    - `layout` "vocab" (what `edgc train --tp` syncs by default, and Megatron too): wte
      split over tp along the vocabulary (V/tp rounded up; Megatron pads the vocabulary to
      a multiple of 128·tp instead), and with pp > 1 the last stage's copy of it for the
      head, split alike, which syncs over DP too; "whole" (`edgc train --tp
      --no-vocab-parallel`): wte and the head's copy whole on every TP rank; "megatron"
      (a simplified Megatron): as "vocab" with the head counted once, on stage 0.

    Raises ValueError if pp exceeds the number of blocks, the layout is unknown or a
    parameter has no known place. Changes nothing.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown tensor-parallel layout {layout!r}; known: {', '.join(LAYOUTS)}")
    n_layer = model.config.n_layer
    if pp > n_layer:
        raise ValueError(f"pp({pp}) exceeds the model's {n_layer} blocks")
    per_stage = [n_layer // pp + (1 if s < n_layer % pp else 0) for s in range(pp)]
    first_block = [sum(per_stage[:s]) for s in range(pp)]
    stage_of_block = {b: s for s in range(pp) for b in range(first_block[s], first_block[s] + per_stage[s])}
    shapes: list[list[tuple[int, ...]]] = [[] for _ in range(pp)]
    head_copy: tuple[int, ...] | None = None
    for name, p in model.named_parameters():  # a tied parameter is yielded once (as wte.weight)
        if name == "wte.weight":
            shard = _shard(p.shape, None if layout == "whole" else 0, tp)  # (V, C) or (V/tp, C)
            shapes[0].append(shard)
            if pp > 1 and layout != "megatron":
                head_copy = shard  # after ln_f (edgc.train.pipeline.GPTStage)
        elif name == "wpe.weight":
            shapes[0].append(_shard(p.shape, None, tp))  # (block_size, C)
        elif name.startswith("ln_f."):
            shapes[pp - 1].append(_shard(p.shape, None, tp))
        elif name.startswith("h."):
            _, index, rest = name.split(".", 2)
            if rest in _TP_SPLIT:
                dim = _TP_SPLIT[rest]
            elif rest in _REPLICATED:
                dim = None
            else:
                raise ValueError(f"parameter {name!r} has no tensor-parallel layout in stage_gradients")
            shapes[stage_of_block[int(index)]].append(_shard(p.shape, dim, tp))
        else:
            raise ValueError(f"parameter {name!r} has no pipeline stage in stage_gradients")
    if head_copy is not None:
        shapes[pp - 1].append(head_copy)
    return [StageGradients(s, tuple(sh)) for s, sh in enumerate(shapes)]
