"""Reading torch.save files without running code they hold.

torch.load(weights_only=False) rebuilds any Python object a file names, by calling the
functions the file names: a crafted checkpoint can run any code on load. edgc reads every
file (and every state blob) with weights_only=True, which rebuilds only tensors and plain
values (numbers, strings, lists, tuples, dicts, torch dtypes and devices); a file that
names anything else is refused with UnsafeFileError, which names the file and what it
holds. trust=True loads a file one trusts as torch.load(weights_only=False) would.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Any

import torch

__all__ = ["UnsafeFileError", "load_torch"]

# torch names what it refused as "GLOBAL module.name" ("posix.system", "__main__.Config")
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
# its own reason when it names no global ("Unsupported operand 149")
_REASON = re.compile(r"WeightsUnpickler error: ([^\n]+)")


class UnsafeFileError(ValueError):
    """A file or blob that only code it names could load (torch.load with weights_only=True
    refused it); the message is one line naming the file, what it holds, and how to load it
    if one trusts it."""


def load_torch(source: str | Path | bytes, *, what: str, how: str, trust: bool = False, mmap: bool = False) -> Any:
    """The object torch.save wrote to the file `source` (or into the bytes `source`), its
    tensors on the CPU; changes nothing. `what` names it in errors ("checkpoint", followed
    by a file's path; a blob's `what` should say which one it is).

    Only tensors and plain values are loaded (weights_only=True). A file that would need
    code to load raises UnsafeFileError: "`what` 'PATH' is refused: it holds posix.system
    ...; if you trust the file, load it with `how`". trust=True loads it anyway
    (weights_only=False): loading it runs whatever code it names, so only for a file one
    trusts. Other failures (a damaged file) are torch's, raised as torch raised them.
    `mmap` maps a file's tensors instead of reading them (torch.load's mmap).
    """
    label = what if isinstance(source, bytes) else f"{what} {str(source)!r}"
    target: str | Path | io.BytesIO = io.BytesIO(source) if isinstance(source, bytes) else source
    try:
        return torch.load(target, map_location="cpu", weights_only=not trust, mmap=mmap)
    except pickle.UnpicklingError as exc:
        if trust or "Weights only load failed" not in str(exc):
            raise
        raise UnsafeFileError(f"{label} is refused: {_held(str(exc))} (it could run any code; edgc loads only "
                              f"tensors and plain values); if you trust the file, load it with {how}") from None


def _held(message: str) -> str:
    """What torch's weights-only refusal `message` says the file holds, in a few words."""
    found = _GLOBAL.search(message)
    if found:
        return f"it holds {found.group(1)}, a Python global that loading would call"
    reason = _REASON.search(message)
    return f"it holds what torch's weights-only loader refuses ({reason.group(1).strip() if reason else 'unknown'})"
