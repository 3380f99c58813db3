"""The rules every config dataclass of edgc follows, read from its fields' annotations.

`field_types` reads each field's type from its annotation, `check_field_types` refuses a
value of another type (a bool where an int belongs, NaN or infinity where a number
belongs), `FieldType.parse` reads a field's value from command-line text by the same
rules, `field_docs` reads the docstring under each field (the CLI's help), and
`reject_unknown_fields` names the keys a mapping has that a config lacks.

A field may also hold another config dataclass (a "section", as EDGCConfig.noise): its
fields follow the same rules, one level down.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import math
import re
import textwrap
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["FieldType", "check_field_types", "field_docs", "field_types", "reject_unknown_fields", "table_fields"]


def reject_unknown_fields(cls: type, values: dict[str, Any], message: str) -> None:
    """Raise ValueError '<message> [...]; known: [...]' if `values` has keys that are not
    fields of the dataclass `cls` (shared by every config's from_dict)."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{message} {unknown}; known: {sorted(known)}")


# ---------------------------------------------------------------- field types, shared by every config

_INT_RANGE = (-(2**63), 2**63)  # what torch and numpy take as an integer
_WORDS = {int: "an integer", float: "a finite number", str: "text", bool: "true or false", dict: "a table of options"}
_METAVARS = {int: "INT", float: "FLOAT", str: "TEXT", bool: "BOOL", dict: "TABLE"}
_NULLS = ("null", "none")
_BOOLS = {"true": True, "false": False}
_INT_TEXT = re.compile(r"[+-]?\d+(_\d+)*")


@dataclass(frozen=True)
class FieldType:
    """What a config field holds, read from its annotation by `field_types`."""

    kind: type
    """int, float, str, bool, dict (a table of another config's options, as TrainConfig.edgc),
    or a config dataclass (a section, as EDGCConfig.noise)."""

    @property
    def section(self) -> bool:
        """Whether the field holds a config dataclass of its own."""
        return dataclasses.is_dataclass(self.kind)

    optional: bool = False
    """None is a value too (`int | None`): "null" on the command line, meaning unset."""

    def mismatch(self, value: Any) -> str | None:
        """None when `value` is of this type, else what it must be, in words ("an integer
        or null"). An int field takes no bool (True is an int in Python) and nothing
        outside 64 bits; a float field takes ints too, but not NaN or infinity."""
        if value is None:
            return None if self.optional else self.expected()
        if self.kind is not bool and isinstance(value, bool):
            return f"{self.expected()}, not true or false"
        if self.kind is int and isinstance(value, int) and not _INT_RANGE[0] <= value < _INT_RANGE[1]:
            return f"an integer in [-2**63, 2**63){' or null' if self.optional else ''}"
        if self.kind is float and isinstance(value, (int, float)):
            return None if math.isfinite(value) else self.expected()
        return None if isinstance(value, self.kind) else self.expected()

    def expected(self) -> str:
        """What a value of this type is, in words: "an integer", "a finite number or null", ..."""
        if self.section:
            return f"a {self.kind.__name__} (or a table of its options)"
        return _WORDS[self.kind] + (" or null" if self.optional else "")

    @property
    def metavar(self) -> str:
        """INT, FLOAT, TEXT or BOOL, with "|null" when optional (for the CLI's help)."""
        return _METAVARS[self.kind] + ("|null" if self.optional else "")

    def parse(self, text: str) -> Any:
        """The value that command-line `text` gives this field; raises ValueError
        "expected <what>, got '<text>'".

        - "null" or "none" (any case) is None where the field is optional;
        - an int field takes decimal digits with an optional sign, "_" allowed between
          digits as in Python and TOML ("524_288"); not "3.0", "1e3" or "true";
        - a float field takes what float() takes ("3e-4", "2"), but not NaN or infinity,
          nor what overflows to it ("1e400");
        - a bool field takes "true" or "false" (any case);
        - a text field takes the text as it is ("2024" stays the text "2024").
        """
        if self.optional and text.strip().lower() in _NULLS:
            return None
        if self.kind is str:
            return text
        value: bool | int | float | None
        if self.kind is bool:
            value = _BOOLS.get(text.strip().lower())
        elif self.kind is int:
            value = None
            if _INT_TEXT.fullmatch(text.strip()):
                # (more than 20 digits cannot fit in 64 bits, and int() refuses past 4300)
                value = int(text) if sum(c.isdigit() for c in text) <= 20 else _INT_RANGE[1]
        elif self.kind is float:
            try:
                value = float(text)
            except ValueError:
                value = None
        else:
            raise ValueError(f"{self.expected()} cannot be given as text")
        wanted = self.expected() if value is None else self.mismatch(value)
        if wanted is not None:
            raise ValueError(f"expected {wanted}, got {text!r}")
        return value


@functools.cache
def field_types(cls: type) -> dict[str, FieldType]:
    """The FieldType of each field of the dataclass `cls`, from its annotations (strings
    under `from __future__ import annotations`, so resolved by typing.get_type_hints).
    Raises TypeError for an annotation other than int, float, str, bool, dict[...], or
    one of them `| None`, so that a new kind of field cannot slip past the checks."""
    hints = typing.get_type_hints(cls)
    out: dict[str, FieldType] = {}
    for f in dataclasses.fields(cls):
        hint, optional = hints[f.name], False
        if typing.get_origin(hint) in (types.UnionType, typing.Union):
            rest = [a for a in typing.get_args(hint) if a is not type(None)]
            hint, optional = (rest[0] if len(rest) == 1 else hint), len(rest) < len(typing.get_args(hint))
        kind = typing.get_origin(hint) or hint
        if dataclasses.is_dataclass(kind) and isinstance(kind, type) and not optional:
            out[f.name] = FieldType(kind)  # a section: a config of its own
            continue
        if kind not in _WORDS:
            raise TypeError(f"{cls.__name__}.{f.name}: no rule for a field of type {hints[f.name]}")
        out[f.name] = FieldType(kind, optional)
    return out


def table_fields(cls: type) -> tuple[str, ...]:
    """The fields of the config dataclass `cls` that are tables of another config's options
    (its dict fields: TrainConfig's "edgc", "expert_edgc" and "dac"), in order."""
    return tuple(name for name, ftype in field_types(cls).items() if ftype.kind is dict)


def check_field_types(config: Any, bad: Callable[[str, str], Any]) -> None:
    """Call `bad(name, "must be <what>")`, which should raise, for the first field of the
    dataclass instance `config` whose value is not of its declared type (FieldType.mismatch),
    then for the first whose value is not among its class's CHOICES for it."""
    cls: type = type(config)
    for name, ftype in field_types(cls).items():
        wanted = ftype.mismatch(getattr(config, name))
        if wanted is not None:
            bad(name, f"must be {wanted}")
        if ftype.section:
            def bad_in_section(sub: str, why: str, _n: str = name) -> None:
                bad(f"{_n}.{sub}", why)

            check_field_types(getattr(config, name), bad_in_section)
    for name, allowed in getattr(config, "CHOICES", {}).items():
        if getattr(config, name) not in allowed:
            bad(name, f"must be one of {allowed}")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of the dataclass `cls`, its whitespace folded to
    single spaces (for the CLI's help); {} when the class's source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    node = tree.body[0]
    assert isinstance(node, ast.ClassDef)  # (the source of a class)
    body = node.body
    docs: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs
