"""Counting the ops a piece of work dispatches: on a GPU each is at least one kernel launch.

    with OpCounter() as counter:
        edgc_hook(state, bucket)
    sum(counter.ops.values())

`OpCounter` is a TorchDispatchMode: it sees every aten op dispatched on this thread while
it is entered (work a future callback runs on another thread is not seen), and counts
them by name, leaving out the ops that only make a view or an empty tensor or read
metadata (`METADATA`), which launch nothing. benchmarks/round_cost.py counts a compression
round with it, and tests/unit/test_round_launches.py checks that the round's count grows
with the shapes of a model, not with its matrices.
"""

from __future__ import annotations

import collections
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["METADATA", "OpCounter"]

#: aten ops that only make a view or an empty tensor, or read metadata: no kernel launch.
METADATA = frozenset({
    "view", "_unsafe_view", "slice", "select", "transpose", "t", "unsqueeze", "squeeze", "as_strided", "expand",
    "permute", "split", "split_with_sizes", "alias", "detach", "unbind", "narrow", "diagonal", "empty",
    "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "_reshape_alias", "reshape",
    "chunk", "set_", "resize_", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
})


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while it is entered, by name (`ops`), metadata-only
    ops left out."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name not in METADATA:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        """Every op counted so far."""
        return sum(self.ops.values())
