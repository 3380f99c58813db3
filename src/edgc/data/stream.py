"""The training batches of a run: one stream of samples shared by all its replicas, so
that a run resumed on another number of replicas goes on with the next samples, none
drawn twice and none passed over.

The stream is a sequence of blocks, each `batch_size` random windows of the training
tokens (their start positions drawn with torch.randint). It interleaves `sequences`
generators, one for each replica the run started with: block b is drawn by generator
b mod S, as the (b div S)-th block that generator draws, generator j seeded
seed * 7919 + j. A step of R replicas, each accumulating A micro-batches, takes the next
R * A blocks, micro-batch m of replica r being block c + m * R + r (c: the blocks taken
before the step). Every process draws every block of the step, in order, and keeps its
own, so all hold the same stream state (checkpointed once, `state_dict`).

While R = S, replica r's blocks all come from generator r, in the order it draws them:
the batches of each replica's own generator, which edgc used before the stream existed
(and a checkpoint of that time, which holds each replica's generator, resumes exactly:
`from_replica_generators`). With another R the blocks are shared out in the same order,
so the run reads the samples it would have read, R * A blocks a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["BatchStream", "windows_at"]


def windows_at(tokens: Any, starts: torch.Tensor, block_size: int, device: str | torch.device = "cpu"
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y), int64 (B, T) tensors on `device`, of the windows of `block_size + 1` ids of
    `tokens` (a TokenFile or an array of ids) starting at `starts` (B,): y is x shifted
    left by one."""
    data = tokens.tokens if hasattr(tokens, "tokens") else tokens
    windows = np.stack([data[i : i + block_size + 1] for i in starts.tolist()])  # (B, T+1)
    buf = torch.from_numpy(windows.astype(np.int64))  # (B, T+1)
    x = buf[:, :-1].contiguous()  # (B, T)
    y = buf[:, 1:].contiguous()  # (B, T)
    device = torch.device(device)
    if device.type == "cuda":
        # pinned host memory lets the copy overlap with compute
        x = x.pin_memory().to(device, non_blocking=True)
        y = y.pin_memory().to(device, non_blocking=True)
    else:
        x, y = x.to(device), y.to(device)
    return x, y


class BatchStream:
    """The blocks of a run's training samples (the module docstring); `sequences`: the
    number of replicas the run started with."""

    def __init__(self, tokens: Any, batch_size: int, block_size: int, *, seed: int, sequences: int) -> None:
        if batch_size < 1 or sequences < 1:
            raise ValueError(f"batch_size and sequences must be at least 1, got {batch_size} and {sequences}")
        data = tokens.tokens if hasattr(tokens, "tokens") else tokens
        if len(data) < block_size + 1:
            raise ValueError(f"need at least block_size + 1 = {block_size + 1} tokens for one sample, have {len(data)}")
        self.tokens, self.batch_size, self.block_size = tokens, batch_size, block_size
        self.span = len(data) - block_size  # (the start positions: 0 .. span - 1)
        self.generators = [torch.Generator().manual_seed(seed * 7919 + j) for j in range(sequences)]
        self.blocks = 0  # taken so far

    def step(self, replicas: int, accum: int, replica: int, device: str | torch.device = "cpu"
             ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Replica `replica`'s `accum` micro-batches (x, y) of the next step of `replicas`
        replicas; the stream moves past the whole step's blocks."""
        if not 0 <= replica < replicas or accum < 1:
            raise ValueError(f"replica {replica} of {replicas} with {accum} micro-batches: out of range")
        mine = []
        count = len(self.generators)
        for k in range(replicas * accum):  # (block self.blocks + k: micro-batch k // replicas of replica k % replicas)
            block = self.blocks + k
            starts = torch.randint(self.span, (self.batch_size,), generator=self.generators[block % count])
            if k % replicas == replica:
                mine.append(starts)
        self.blocks += replicas * accum
        return [windows_at(self.tokens, starts, self.block_size, device) for starts in mine]

    def state_dict(self) -> dict[str, Any]:
        """{"blocks": taken so far, "generators": each generator's state (uint8 tensors)}."""
        return {"blocks": self.blocks, "generators": [g.get_state() for g in self.generators]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()`'s state, whatever the number of replicas now. Raises
        ValueError when it holds another number of generators than this stream."""
        states = list(state["generators"])
        if len(states) != len(self.generators):
            raise ValueError(f"the saved batch stream interleaves {len(states)} generators, this one "
                             f"{len(self.generators)}: build it with sequences={len(states)}")
        for g, s in zip(self.generators, states, strict=True):
            g.set_state(s)
        self.blocks = int(state["blocks"])

    @classmethod
    def from_replica_generators(cls, tokens: Any, batch_size: int, block_size: int, *, seed: int,
                                states: Sequence[torch.Tensor], step: int, accum: int) -> BatchStream:
        """The stream of a checkpoint written before it existed, which holds each of its
        len(states) replicas' own generator after `step` steps of `accum` micro-batches."""
        stream = cls(tokens, batch_size, block_size, seed=seed, sequences=len(states))
        stream.load_state_dict({"blocks": step * accum * len(states), "generators": list(states)})
        return stream
