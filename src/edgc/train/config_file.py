"""Reading option files and checking folder paths for TrainConfig (edgc.train.config)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, packaged for Python 3.10 (a dependency there only)
    import tomli as tomllib

__all__ = ["check_folder_path", "load_config_file"]


def check_folder_path(name: str, path: str, writable: bool = False) -> None:
    """Raise ValueError unless the folder `path` (field `name`) exists or could be made:
    it must not be empty, nor a file, nor lie under a file; and if `writable`, this
    process must be able to write in it, or make it (os.access: a read-only file system,
    or no write permission, is refused now rather than at the first file a run writes)."""
    if not path:
        raise ValueError(f"{name}={path!r}: must name a folder")
    here = Path(path)
    try:
        existing = next((p for p in (here, *here.parents) if p.exists()), None)  # "." or "/" at the latest
    except (OSError, ValueError) as exc:  # (a name too long, a NUL byte)
        raise ValueError(f"{name}={path!r}: not a usable folder path ({exc})") from None
    if existing is not None and not existing.is_dir():
        where = "is a file" if existing == here else f"lies under {str(existing)!r}, which is a file"
        raise ValueError(f"{name}={path!r}: {where}, not a folder")
    if writable and existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        what = "this folder" if existing == here else f"{str(existing)!r}, where it would be made,"
        raise ValueError(f"{name}={path!r}: cannot be written: {what} is read-only here (a read-only file system "
                         f"or no write permission)")


def load_config_file(path: str | Path, tables: tuple[str, ...] = ()) -> dict[str, Any]:
    """Read a TOML or JSON config file into a dict (keys as TrainConfig fields, and an
    [edgc] table / "edgc" object for EDGCConfig fields). Each key in `tables` that the
    file has must hold a table (e.g. ("edgc", "dac") for training options).

    Raises FileNotFoundError for a missing file and ValueError, naming the file, for a
    folder, a name ending in neither .toml nor .json, unreadable or non-UTF-8 bytes, a
    syntax error, or content that is not a table. Changes nothing.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"config file {str(path)!r} is a folder, not a file")
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    kind = path.suffix[1:].upper()
    if kind not in ("TOML", "JSON"):
        raise ValueError(f"config file {str(path)!r}: only TOML (.toml) and JSON (.json) config files are supported")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"config file {str(path)!r} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ValueError(f"config file {str(path)!r} cannot be read: {exc.strerror or exc}") from None
    try:
        values = tomllib.loads(text) if kind == "TOML" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"config file {str(path)!r} is not valid {kind}: {exc}") from None
    if not isinstance(values, dict):
        raise ValueError(f"config file {str(path)!r} must hold a table of options (keys and values), "
                         f"not a {_json_kind(values)}")
    for key in tables:
        if key in values and not isinstance(values[key], dict):
            table = f"an [{key}] table" if kind == "TOML" else f'a "{key}" object'
            raise ValueError(f"config file {str(path)!r}: {key} must be {table} of options, "
                             f"not the {_json_kind(values[key])} {values[key]!r}")
    return values


def _json_kind(value: Any) -> str:
    """The JSON name of a parsed value's type ("list", "number", "text", ...)."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return {list: "list", str: "text", type(None): "null"}.get(type(value), type(value).__name__)
