"""Where training text comes from: user-given files and folders, or a built-in corpus.

The built-in corpus needs no download: it is the running interpreter's own standard
library, about 670 `.py` files and 11 MB of text on CPython 3.11. It is real, varied
text with long-range structure, which is enough to make a small GPT's loss fall in a
way that looks like language-model training (it is not a benchmark corpus, and its
exact content depends on the Python version).

Train and validation are split by *file*, by a hash of each file's relative path, so
the two never share a document and the split does not depend on which other files are
present (a size cap changes which files are used, not which side a file falls on).
"""

from __future__ import annotations

import codecs
import hashlib
import logging
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = [
    "Corpus",
    "CorpusSplit",
    "builtin_corpus",
    "split_corpus",
    "iter_text_files",
    "is_text_file",
    "read_text",
]

DEFAULT_VAL_FRACTION = 0.05
"""Share of files that go to validation, in expectation."""

# Folders of the standard library left out of the built-in corpus: test suites (large,
# repetitive, some deliberately malformed files), IDLE, and third-party packages.
_EXCLUDED_STDLIB_DIRS = frozenset(
    {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"}
)

_SNIFF_BYTES = 8192


@dataclass(frozen=True)
class Corpus:
    """An ordered set of text files under one root folder."""

    root: Path
    """Folder the relative paths are relative to."""

    files: tuple[str, ...]
    """Relative paths in POSIX form, sorted; these are also the keys of the split."""

    def paths(self) -> list[Path]:
        """Returns the absolute paths of the files, in order."""
        return [self.root / rel for rel in self.files]

    def total_bytes(self) -> int:
        """Returns the summed size of the files on disk."""
        return sum(p.stat().st_size for p in self.paths())

    def texts(self) -> Iterator[str]:
        """Yields each file's text, one file at a time, in order."""
        for path in self.paths():
            yield read_text(path)


@dataclass(frozen=True)
class CorpusSplit:
    """Disjoint train and validation parts of one corpus."""

    train: Corpus
    val: Corpus


def builtin_corpus(max_bytes: int | None = None) -> Corpus:
    """Returns the built-in corpus: this interpreter's standard-library `.py` sources,
    without test suites, IDLE and site-packages, sorted by relative path.

    With `max_bytes`, keeps the longest prefix of that order whose total size is at most
    `max_bytes`. Raises FileNotFoundError if the interpreter ships no sources, and
    ValueError if `max_bytes` leaves no file.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(
            f"the built-in corpus reads Python's standard-library sources, but the folder "
            f"{root} does not exist; pass your own text files or folders instead"
        )
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _EXCLUDED_STDLIB_DIRS.isdisjoint(rel.parts[:-1]) and path.is_file():
            found.append(rel.as_posix())
    if not found:
        raise FileNotFoundError(
            f"no .py sources under {root} (this Python may ship only compiled files); "
            f"pass your own text files or folders instead"
        )
    found.sort()

    files, total = [], 0
    for rel in found:
        size = (root / rel).stat().st_size
        if max_bytes is not None and total + size > max_bytes:
            break
        files.append(rel)
        total += size
    if not files:
        raise ValueError(
            f"max_bytes={max_bytes} is smaller than the first built-in corpus file "
            f"{found[0]} ({(root / found[0]).stat().st_size} bytes); raise max_bytes"
        )
    logger.info(
        "built-in corpus: %d of %d files from %s, %d bytes", len(files), len(found), root, total
    )
    return Corpus(root=root, files=tuple(files))


def _hash_fraction(key: str) -> float:
    """Maps a string to a number in [0, 1), the same on every machine and run (unlike
    the built-in hash(), which is salted per process)."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_corpus(corpus: Corpus, val_fraction: float = DEFAULT_VAL_FRACTION) -> CorpusSplit:
    """Splits a corpus into train and validation by file.

    A file goes to validation when the hash of its relative path falls below
    `val_fraction`, so each file's side is fixed by its name alone. If that leaves one
    side empty, the file with the lowest hash moves to validation (or the highest to
    train), so both sides are non-empty. Returns the split; changes nothing. Raises
    ValueError for fewer than two files or a fraction outside (0, 1).
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if len(corpus.files) < 2:
        raise ValueError(
            f"cannot split {len(corpus.files)} file(s) into non-empty train and validation "
            f"parts; give at least two files"
        )
    by_hash = sorted(corpus.files, key=_hash_fraction)
    n_val = sum(_hash_fraction(rel) < val_fraction for rel in by_hash)
    n_val = min(max(n_val, 1), len(by_hash) - 1)
    val = set(by_hash[:n_val])
    train_files = tuple(rel for rel in corpus.files if rel not in val)
    val_files = tuple(rel for rel in corpus.files if rel in val)
    logger.info(
        "split %d files: %d train, %d validation",
        len(corpus.files), len(train_files), len(val_files),
    )
    return CorpusSplit(
        train=Corpus(root=corpus.root, files=train_files),
        val=Corpus(root=corpus.root, files=val_files),
    )


def is_text_file(path: Path) -> bool:
    """Returns whether the file looks like UTF-8 text: its first 8 KiB hold no NUL byte
    and decode as UTF-8 (a character cut at the 8 KiB boundary is allowed)."""
    with open(path, "rb") as f:
        head = f.read(_SNIFF_BYTES)
    if b"\x00" in head:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return True


def read_text(path: Path) -> str:
    """Returns the file's text decoded as UTF-8; an undecodable byte further into a file
    that passed `is_text_file` becomes U+FFFD rather than failing a long run."""
    return Path(path).read_bytes().decode("utf-8", errors="replace")


def iter_text_files(paths: str | Path | Iterable[str | Path]) -> Iterator[Path]:
    """Yields the text files named by `paths` (one path, or several), in the order
    given: a file as itself, a folder as every text file below it, recursively, sorted
    by relative path. Hidden files and folders (names starting with ".") inside a folder
    are skipped, and so are files that are not text (see `is_text_file`); a file named
    directly must be text. Each file is yielded once.

    Raises FileNotFoundError for a path that does not exist, and ValueError if a named
    file is not text or nothing textual is found at all.
    """
    paths = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    if not paths:
        raise ValueError("no input paths given; pass text files or folders")
    seen: set[Path] = set()
    n_yielded = 0
    for path in paths:
        if not path.exists():
            raise FileNotFoundError(
                f"input path {str(path)!r} does not exist; pass existing text files or "
                f"folders (or leave the paths out to use the built-in corpus)"
            )
        if path.is_file():
            if not is_text_file(path):
                raise ValueError(f"input file {str(path)!r} is not UTF-8 text")
            candidates = [path]
        else:
            candidates = sorted(
                (p for p in path.rglob("*") if p.is_file()),
                key=lambda p: p.relative_to(path).as_posix(),
            )
            candidates = [
                p for p in candidates
                if not any(part.startswith(".") for part in p.relative_to(path).parts)
            ]
        for candidate in candidates:
            key = candidate.resolve()
            if key in seen:
                continue
            if candidate is not path and not is_text_file(candidate):
                logger.debug("skipping non-text file %s", candidate)
                continue
            seen.add(key)
            n_yielded += 1
            yield candidate
    if n_yielded == 0:
        raise ValueError(
            f"no text files found in {', '.join(repr(str(p)) for p in paths)}; "
            f"pass folders that contain UTF-8 text files"
        )
