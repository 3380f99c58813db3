"""Where training text comes from: user-given files and folders, or a built-in corpus.

The built-in corpus needs no download: it is the running interpreter's own standard
library, about 670 `.py` files and 11 MB of text on CPython 3.11. It is real, varied
text with long-range structure, which is enough to make a small GPT's loss fall in a
way that looks like language-model training (it is not a benchmark corpus, and its
exact content depends on the Python version).

The built-in corpus leaves out generated files and data tables (`edgc.data.generated`:
code-page maps, entity lists, Sphinx's topic dump) and near-duplicate files
(`edgc.data.dedup`: the first of each family is kept). Before this, two code-page tables
made 46% of the validation bytes, and one was a 99% copy of a training file, so the
validation loss measured mostly lookup tables.

Train and validation are split by *file*, by a hash of each file's relative path, so
the two never share a document and the split does not depend on which other files are
present (a size cap changes which files are used, not which side a file falls on).
`near_twins` checks that no validation file has a near-duplicate in train.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import logging
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from edgc.data.dedup import DEFAULT_THRESHOLD, keep_first, similar_pairs
from edgc.data.generated import generated_reason

logger = logging.getLogger(__name__)

__all__ = [
    "BUILTIN_CORPUS_VERSION",
    "BUILTIN_VAL_FRACTION",
    "BuiltinSelection",
    "Corpus",
    "CorpusSplit",
    "NearTwin",
    "builtin_corpus",
    "builtin_selection",
    "drop_near_duplicates",
    "near_twins",
    "split_corpus",
    "iter_text_files",
    "is_text_file",
    "read_text",
]

DEFAULT_VAL_FRACTION = 0.05
"""Share of files that go to validation, in expectation."""

BUILTIN_VAL_FRACTION = 0.15
"""The built-in corpus's validation share: larger than the default so that the validation
loss of a short `tiny` run has a standard error of at most 0.2% (see
`edgc.train.evaluation`). Measured: the block losses of `tiny` after 300 steps have a
standard deviation of about 0.46 nats at a loss of about 5.0, so the SE needs about 2,000
blocks of 128 tokens; 15% of the whole selection is about 1.1 MB of validation text."""

BUILTIN_CORPUS_VERSION = 2
"""Bumped whenever the built-in corpus's selection or split changes, and part of the name
of its token cache, so that an old cache is never reused. 2: generated files and
near-duplicates left out, validation share 0.15."""

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


@dataclass(frozen=True)
class BuiltinSelection:
    """Which standard-library sources the built-in corpus keeps, and why others are out."""

    root: Path
    """The standard library's folder."""

    kept: tuple[str, ...]
    """Relative paths kept, sorted."""

    generated: dict[str, str] = field(default_factory=dict)
    """Left out as generated or data files: {path: reason} (see `edgc.data.generated`)."""

    duplicates: dict[str, str] = field(default_factory=dict)
    """Left out as near-duplicates: {path: the kept earlier file it duplicates}."""

    def bytes_of(self, files: Iterable[str]) -> int:
        """Returns the summed size of the given relative paths on disk."""
        return sum((self.root / rel).stat().st_size for rel in files)


def _stdlib_sources() -> tuple[Path, list[str]]:
    """The standard library's folder and its `.py` sources outside the excluded folders,
    sorted by relative path. Raises FileNotFoundError if there are none."""
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
    return root, found


@functools.lru_cache(maxsize=1)
def builtin_selection() -> BuiltinSelection:
    """Returns the built-in corpus's selection from this interpreter's standard library:
    every `.py` source outside test suites, IDLE and site-packages, less generated or
    data files, less near-duplicates (the alphabetically first of each family is kept).

    Reads every source once (about 2 s for CPython 3.11's 11 MB on one core, measured);
    the result is cached for the process. Logs how many files each filter removed.
    Raises FileNotFoundError if the interpreter ships no sources.
    """
    root, found = _stdlib_sources()
    texts: dict[str, str] = {}
    generated: dict[str, str] = {}
    for rel in found:
        text = read_text(root / rel)
        reason = generated_reason(text)
        if reason is None:
            texts[rel] = text
        else:
            generated[rel] = reason
    candidates = [rel for rel in found if rel not in generated]
    pairs = similar_pairs(len(candidates), lambda i: texts[candidates[i]])
    dropped = keep_first(len(candidates), pairs)
    duplicates = {candidates[j]: candidates[i] for j, i in sorted(dropped.items())}
    kept = tuple(rel for rel in candidates if rel not in duplicates)
    selection = BuiltinSelection(root=root, kept=kept, generated=generated, duplicates=duplicates)
    logger.info(
        "built-in corpus: %d of %d sources kept; left out %d generated or data files (%d bytes) "
        "and %d near-duplicates (%d bytes)",
        len(kept), len(found), len(generated), selection.bytes_of(generated),
        len(duplicates), selection.bytes_of(duplicates),
    )
    return selection


def builtin_corpus(max_bytes: int | None = None) -> Corpus:
    """Returns the built-in corpus: the sources `builtin_selection` keeps (the standard
    library without tests, IDLE, site-packages, generated or data files and
    near-duplicates), sorted by relative path.

    With `max_bytes`, keeps the longest prefix of that order whose total size is at most
    `max_bytes`. Raises FileNotFoundError if the interpreter ships no sources, and
    ValueError if `max_bytes` leaves no file.
    """
    selection = builtin_selection()
    root, found = selection.root, selection.kept
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
        "built-in corpus: %d of %d selected files from %s, %d bytes", len(files), len(found), root, total
    )
    return Corpus(root=root, files=tuple(files))


@dataclass(frozen=True)
class NearTwin:
    """A validation file and a training file that are near-duplicates."""

    val: str
    train: str
    jaccard: float
    """Their shingle Jaccard similarity (see `edgc.data.dedup`)."""


def near_twins(split: CorpusSplit, threshold: float = DEFAULT_THRESHOLD) -> list[NearTwin]:
    """Returns every (validation file, training file) pair of `split` whose shingle
    Jaccard similarity is at least `threshold`, sorted by validation file; empty when
    the validation loss cannot be lowered by having seen a copy in training. Changes
    nothing. Raises ValueError if the two sides have different roots."""
    if split.val.root != split.train.root:
        raise ValueError(f"the split's sides have different roots: {split.val.root} and {split.train.root}")
    files = split.val.files + split.train.files
    n_val = len(split.val.files)
    root = split.val.root
    pairs = similar_pairs(len(files), lambda i: read_text(root / files[i]), threshold,
                          allowed=lambda i, j: i < n_val <= j)
    return [NearTwin(files[p.first], files[p.second], p.jaccard) for p in pairs]


def drop_near_duplicates(corpus: Corpus, threshold: float = DEFAULT_THRESHOLD) -> tuple[Corpus, dict[str, str]]:
    """Returns (the corpus less its near-duplicate files, {dropped file: the kept file it
    duplicates}). The first file of each family, in the corpus's order, is kept. Changes
    nothing on disk."""
    pairs = similar_pairs(len(corpus.files), lambda i: read_text(corpus.root / corpus.files[i]), threshold)
    dropped = keep_first(len(corpus.files), pairs)
    twins = {corpus.files[j]: corpus.files[i] for j, i in sorted(dropped.items())}
    kept = tuple(rel for rel in corpus.files if rel not in twins)
    return Corpus(root=corpus.root, files=kept), twins


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
    roots = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    if not roots:
        raise ValueError("no input paths given; pass text files or folders")
    seen: set[Path] = set()
    n_yielded = 0
    for path in roots:
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
            f"no text files found in {', '.join(repr(str(p)) for p in roots)}; "
            f"pass folders that contain UTF-8 text files"
        )
