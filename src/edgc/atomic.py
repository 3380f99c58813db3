"""Atomic file writes: readers see the old file or the complete new one, never a torn one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_write"]


@contextlib.contextmanager
def atomic_write(path: str | Path) -> Iterator[BinaryIO]:
    """Opens a temporary file beside `path` for binary writing and, when the `with` block
    ends without an exception, flushes it to disk and renames it onto `path` (os.replace
    is atomic within one file system). On an exception the temporary file is removed and
    `path` is left as it was. Creates the parent folder if needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            # mkstemp makes the file private (0600); give it a data file's usual permissions
            os.fchmod(f.fileno(), 0o644)
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
