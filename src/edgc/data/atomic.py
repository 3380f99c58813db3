"""`atomic_write`'s former place: it is in edgc.atomic, which the core (edgc.checkpoint)
imports without this package's tokenizers."""

from edgc.atomic import atomic_write

__all__ = ["atomic_write"]
