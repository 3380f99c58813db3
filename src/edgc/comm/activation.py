"""Low-rank compression of the activation gradients sent backward between pipeline stages
(beyond the EDGC release, which sends them whole; Optimus-CC compresses them).

How it rides on torch.distributed.pipelining without touching its send/receive code.
A stage with a next stage returns two tensors instead of its activation x (B, T, C):

- x.detach(): sent forward as usual; since it does not require grad, the next stage sends
  no gradient back for it;
- a "carrier" (B, T + C, r) from `Carrier`, zeros in the forward pass (its bytes are the
  price: (T + C)·r per sample forward), whose gradient is the compressed message.

The next stage passes both to `Unpack`, which returns x for its blocks. In the backward
pass `Unpack` receives x's gradient G (B, T, C), compresses each sample's T×C matrix with
one PowerSGD round (P = G Q, orthonormalise P, Q = Gᵀ P) plus error feedback and a
warm-started Q per micro-batch, and returns [P; Q] as the carrier's gradient: the
pipeline sends (T + C)·r numbers per sample backward instead of T·C. On the first stage
`Carrier` turns [P; Q] back into G ≈ P Qᵀ for the rest of its backward pass.

The sender of the compressed message is a single stage, so no collective is needed and
the error feedback is exact: what was not sent this step is added to the next step's
gradient of the same micro-batch slot.
"""

from __future__ import annotations

from typing import Any

import torch

from edgc.compress import (
    draw_q,
    error_feedback_,
    orthogonalize_,
    project_p,
    project_q,
    reconstruct,
)

__all__ = ["ActivationGradCompressor", "Carrier", "Unpack", "resized_activation_state"]


class ActivationGradCompressor:
    """Error feedback and warm-start Q of the activation gradients one stage sends back,
    one slot per micro-batch (slots are taken in backward order and reset each step)."""

    def __init__(self, rank: int, seed: int = 0) -> None:
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"activation rank must be a positive integer, got {rank!r}")
        self.rank = rank
        self.generator = torch.Generator().manual_seed(seed)
        self.errors: list[torch.Tensor] = []
        self.qs: list[torch.Tensor] = []
        self.slot = 0
        self.bytes_sent = 0  # backward bytes of the compressed messages
        self.bytes_uncompressed = 0  # what the whole gradients would have been

    def start_step(self) -> None:
        self.slot = 0

    def compress(self, g: torch.Tensor) -> torch.Tensor:
        """G (B, T, C) -> packed [P; Q] (B, T + C, r), keeping G - P Qᵀ for this slot."""
        b, t, c = g.shape
        r = min(self.rank, t, c)
        slot = self.slot
        self.slot += 1
        if slot == len(self.errors):
            self.errors.append(torch.zeros_like(g))
            self.qs.append(draw_q(b, c, r, self.generator, dtype=g.dtype, device=g.device))
        error, q = self.errors[slot], self.qs[slot]
        if error.shape != g.shape:
            raise RuntimeError(f"micro-batch {slot} changed shape from {tuple(error.shape)} to {tuple(g.shape)}")
        m = g + error
        p = orthogonalize_(project_p(m, q))  # (B, T, r)
        q = project_q(m, p)  # (B, C, r)
        self.errors[slot] = error_feedback_(m, reconstruct(p, q))
        self.qs[slot] = q
        packed = torch.cat([p, q], dim=1)
        self.bytes_sent += packed.numel() * packed.element_size()
        self.bytes_uncompressed += g.numel() * g.element_size()
        return packed

    def state_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "generator": self.generator.get_state(),
                "errors": [e.detach().cpu().clone() for e in self.errors],
                "qs": [q.detach().cpu().clone() for q in self.qs],
                "bytes_sent": self.bytes_sent, "bytes_uncompressed": self.bytes_uncompressed}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if d["rank"] != self.rank:
            raise ValueError(f"activation compression state has rank {d['rank']}, this run {self.rank}")
        self.generator.set_state(d["generator"])
        self.errors = list(d["errors"])
        self.qs = list(d["qs"])
        self.bytes_sent, self.bytes_uncompressed = int(d["bytes_sent"]), int(d["bytes_uncompressed"])


def resized_activation_state(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One replica's activation-compression state for a pipeline resumed on another number
    of replicas, from the old replicas' `states` (state_dict's): Q, the generator and the
    counters of the first; each micro-batch slot's error feedback the replicas' mean
    (summed in float64, kept in its dtype), which keeps what is still to be sent on average."""
    first = states[0]
    if any(len(s["errors"]) != len(first["errors"]) for s in states):
        raise ValueError("the replicas' activation states hold different numbers of micro-batch slots")
    errors = [torch.stack([s["errors"][k].double() for s in states]).mean(dim=0).to(e.dtype)
              for k, e in enumerate(first["errors"])]
    return {**first, "errors": errors, "qs": [q.clone() for q in first["qs"]]}


class Carrier(torch.autograd.Function):
    """Forward: zeros (B, T + C, r) tied to x; backward: the received [P; Q] -> P Qᵀ."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rank: int) -> torch.Tensor:
        b, t, c = x.shape
        ctx.t = t
        return x.new_zeros(b, t + c, min(rank, t, c))

    @staticmethod
    def backward(ctx: Any, packed: torch.Tensor) -> tuple[torch.Tensor, None]:
        p, q = packed[:, : ctx.t], packed[:, ctx.t :]
        return reconstruct(p, q), None


class Unpack(torch.autograd.Function):
    """Forward: x (the carrier only links the graph); backward: x's gradient compressed
    into the carrier's gradient, none for x (it is not sent)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, carrier: torch.Tensor, compressor: ActivationGradCompressor) -> torch.Tensor:
        ctx.compressor = compressor
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[None, torch.Tensor, None]:
        return None, ctx.compressor.compress(g.contiguous()), None
