"""Turn text into token files: user-given files and folders, or the built-in corpus.

Each document (one text file) is encoded and followed by the tokenizer's end-of-text id,
as in GPT-2's training data. Files are read and encoded a batch at a time and the ids
streamed to disk, so memory holds one batch of text, not the corpus.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from edgc.data.corpus import (
    BUILTIN_VAL_FRACTION,
    DEFAULT_VAL_FRACTION,
    Corpus,
    builtin_corpus,
    drop_near_duplicates,
    iter_text_files,
    near_twins,
    read_text,
    split_corpus,
)
from edgc.data.tokenizer import Tokenizer, load_tokenizer, train_bpe_tokenizer
from edgc.data.tokens import TokenFile, TokenFileHeader, write_token_file

logger = logging.getLogger(__name__)

__all__ = ["PreparedData", "builtin_folder", "data_tokenizer", "ensure_builtin", "prepare", "prepare_builtin",
           "prepare_files", "write_meta"]

TOKENIZER_FILE = "tokenizer.json"
"""A local BPE's file inside a prepared data folder; meta.json names it relative to the
folder, so the folder works from any directory and after a move."""

# Characters of text encoded per batch call: large enough for the tokenizers' thread
# pools to have work, small enough to keep memory flat.
_BATCH_CHARS = 4_000_000


@dataclass(frozen=True)
class PreparedData:
    """Where `prepare_builtin` put its outputs."""

    train: Path
    """Token file of the training split."""

    val: Path
    """Token file of the validation split."""

    tokenizer: str
    """"gpt2", or the saved BPE JSON's path relative to the data folder (see
    `data_tokenizer`)."""

    train_tokens: int
    val_tokens: int

    duplicates: dict[str, str] = field(default_factory=dict)
    """Files left out as near-duplicates: {file: the kept file it duplicates}, paths
    relative to the inputs' common folder (empty for the built-in corpus, whose
    selection already leaves them out, and with keep_duplicates)."""


def _text_batches(texts: Iterable[str], max_chars: int = _BATCH_CHARS) -> Iterator[list[str]]:
    """Groups non-empty texts into lists of about `max_chars` characters, in order."""
    batch: list[str] = []
    n_chars = 0
    for text in texts:
        if not text:
            continue
        batch.append(text)
        n_chars += len(text)
        if n_chars >= max_chars:
            yield batch
            batch, n_chars = [], 0
    if batch:
        yield batch


def _write_documents(texts: Iterable[str], tokenizer: Tokenizer, out: Path) -> TokenFileHeader:
    """Encodes each non-empty text, appends the end-of-text id, and streams the ids into
    a token file at `out`. Returns its header. Raises ValueError if all texts are empty."""

    def ids() -> Iterator[list[int]]:
        n_docs = 0
        for batch in _text_batches(texts):
            for doc_ids in tokenizer.encode_batch(batch):
                doc_ids.append(tokenizer.eot_id)
                n_docs += 1
                yield doc_ids
        if n_docs == 0:
            # raised inside the write, so no empty token file is left behind
            raise ValueError(f"no text to tokenise for {out}: every input file is empty")

    return write_token_file(
        ids(), out, vocab_size=tokenizer.vocab_size, tokenizer_name=tokenizer.name
    )


def prepare(
    paths: str | Path | Iterable[str | Path],
    out: str | Path,
    tokenizer_spec: str | Path = "gpt2",
) -> Path:
    """Tokenises the text files named by `paths` (files, or folders searched
    recursively; see `iter_text_files`) into one token file at `out`, each file a
    document followed by end-of-text. Returns `out` as a Path.

    Raises FileNotFoundError for a missing input path or tokenizer, and ValueError if no
    text is found.
    """
    out = Path(out)
    tokenizer = load_tokenizer(tokenizer_spec)
    start = time.perf_counter()
    files = iter_text_files(paths)
    header = _write_documents((read_text(p) for p in files), tokenizer, out)
    logger.info(
        "prepared %s: %d tokens with %s in %.1fs",
        out, header.count, tokenizer.name, time.perf_counter() - start,
    )
    return out


def prepare_builtin(
    out_dir: str | Path,
    tokenizer: str = "bpe",
    max_bytes: int | None = None,
    vocab_size: int = 2048,
    val_fraction: float = BUILTIN_VAL_FRACTION,
) -> PreparedData:
    """Builds `train.bin` and `val.bin` in `out_dir` from the built-in corpus (the
    standard library's sources without generated files and near-duplicates, at most
    `max_bytes` of them; see `builtin_corpus`), split by file so the two share no
    document.

    With tokenizer="bpe", first trains a byte-level BPE of `vocab_size` tokens on the
    train split only and saves it as `out_dir/tokenizer.json`; otherwise `tokenizer` is
    a spec for `load_tokenizer` (e.g. "gpt2") and `vocab_size` is unused. Overwrites
    existing outputs. Returns their paths and token counts.
    """
    out_dir = Path(out_dir)
    start = time.perf_counter()
    split = split_corpus(builtin_corpus(max_bytes), val_fraction)
    if tokenizer == "bpe":
        bpe = train_bpe_tokenizer(split.train.texts(), vocab_size=vocab_size)
        bpe.save(out_dir / TOKENIZER_FILE)
        tok: Tokenizer = bpe
        spec = TOKENIZER_FILE
    else:
        tok = load_tokenizer(tokenizer)
        spec = tokenizer
    train = _write_documents(split.train.texts(), tok, out_dir / "train.bin")
    val = _write_documents(split.val.texts(), tok, out_dir / "val.bin")
    logger.info(
        "prepared built-in corpus in %s: %d train files / %d tokens, %d val files / %d tokens, "
        "tokenizer %s, %.1fs",
        out_dir, len(split.train.files), train.count, len(split.val.files), val.count,
        tok.name, time.perf_counter() - start,
    )
    return PreparedData(
        train=out_dir / "train.bin",
        val=out_dir / "val.bin",
        tokenizer=spec,
        train_tokens=train.count,
        val_tokens=val.count,
    )


def prepare_files(
    paths: str | Path | Iterable[str | Path],
    out_dir: str | Path,
    tokenizer_spec: str | Path = "gpt2",
    val_fraction: float = DEFAULT_VAL_FRACTION,
    vocab_size: int = 2048,
    keep_duplicates: bool = False,
) -> PreparedData:
    """Builds a training data folder from the user's text files and folders: `train.bin`
    and `val.bin`, split by file (see `split_corpus`), and `meta.json`.

    Near-duplicate files (shingle Jaccard >= 0.7, see `edgc.data.dedup`) are left out,
    the first of each family in path order kept, so that no validation file has a copy in
    train; `keep_duplicates` keeps them all (and logs a warning for each validation file
    with a near-twin in train). Generated-looking files are kept: unlike the built-in
    corpus, what counts as text here is the user's call.

    `tokenizer_spec`: "gpt2", "bpe" (a byte-level BPE of `vocab_size` tokens trained here
    on the train split only), or a saved BPE JSON file. A BPE is kept in the folder as
    tokenizer.json, so the folder does not depend on where it was made from. Raises
    FileNotFoundError for a missing path or tokenizer, ValueError when there is no text
    or fewer than two files.
    """
    out_dir = Path(out_dir)
    # (a bad spec fails before any work)
    tokenizer = None if str(tokenizer_spec) == "bpe" else load_tokenizer(tokenizer_spec)
    files = list(iter_text_files(paths))
    root = Path(os.path.commonpath([str(f.resolve().parent) for f in files]))
    corpus = Corpus(root=root, files=tuple(sorted(f.resolve().relative_to(root).as_posix() for f in files)))
    duplicates: dict[str, str] = {}
    if not keep_duplicates:
        corpus, duplicates = drop_near_duplicates(corpus)
        logger.info("left out %d near-duplicate file(s) of %d", len(duplicates), len(corpus.files) + len(duplicates))
        if len(corpus.files) < 2 <= len(files):
            raise ValueError(
                f"the {len(files)} input files are near-duplicates of one another, which leaves "
                f"{len(corpus.files)} to split into train and validation; give more files, or keep "
                f"them with --keep-duplicates"
            )
    split = split_corpus(corpus, val_fraction)
    if keep_duplicates:
        for twin in near_twins(split):
            logger.warning("validation file %s is a near-duplicate of training file %s (Jaccard %.2f)",
                           twin.val, twin.train, twin.jaccard)
    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        tokenizer = train_bpe_tokenizer(split.train.texts(), vocab_size=vocab_size)
        tokenizer.save(out_dir / TOKENIZER_FILE)
        spec = TOKENIZER_FILE
    elif str(tokenizer_spec) == "gpt2":
        spec = "gpt2"
    else:
        target = out_dir / TOKENIZER_FILE
        if Path(tokenizer_spec).resolve() != target.resolve():
            shutil.copyfile(tokenizer_spec, target)
        spec = TOKENIZER_FILE
    train = _write_documents(split.train.texts(), tokenizer, out_dir / "train.bin")
    val = _write_documents(split.val.texts(), tokenizer, out_dir / "val.bin")
    source = ", ".join(str(Path(p).resolve()) for p in ([paths] if isinstance(paths, (str, Path)) else paths))
    write_meta(out_dir, spec, tokenizer.vocab_size, train.count, val.count, source=source,
               files=(len(split.train.files), len(split.val.files)))
    return PreparedData(train=out_dir / "train.bin", val=out_dir / "val.bin", tokenizer=spec,
                        train_tokens=train.count, val_tokens=val.count, duplicates=duplicates)


def write_meta(folder: Path, tokenizer: str, vocab_size: int, train_tokens: int, val_tokens: int, source: str,
               files: tuple[int, int] | None = None) -> None:
    """meta.json beside train.bin and val.bin: what the trainer needs to know about them.

    `tokenizer` is "gpt2" or a path; a path inside `folder` is stored relative to it.
    """
    folder = Path(folder)
    if tokenizer != "gpt2":
        path = Path(tokenizer) if Path(tokenizer).is_absolute() else folder / tokenizer
        if not Path(tokenizer).is_absolute() and not path.is_file():
            path = Path(tokenizer)  # given relative to the working directory
        path = path.resolve()
        try:
            tokenizer = path.relative_to(folder.resolve()).as_posix()
        except ValueError:
            tokenizer = str(path)
    meta = {"tokenizer": tokenizer, "vocab_size": vocab_size, "train_tokens": train_tokens,
            "val_tokens": val_tokens, "source": source}
    if files is not None:
        meta["train_files"], meta["val_files"] = files
    (folder / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def builtin_folder(cache: str | Path, tokenizer: str = "bpe", vocab_size: int = 2048,
                   max_bytes: int | None = None) -> Path:
    """Where the built-in corpus is prepared inside the cache folder `cache`, for this
    tokenizer and size. The version tag changes whenever the built-in selection or split
    does, so that an old cache (e.g. one with the code-page tables, before version 2) is
    never reused."""
    from edgc.data.corpus import BUILTIN_CORPUS_VERSION

    vocab = vocab_size if tokenizer == "bpe" else ""
    return Path(cache) / f"builtin-v{BUILTIN_CORPUS_VERSION}-{tokenizer}{vocab}-{max_bytes or 'all'}"


def ensure_builtin(folder: str | Path, tokenizer: str = "bpe", max_bytes: int | None = None,
                   vocab_size: int = 2048) -> Path:
    """`folder`, with the built-in corpus prepared in it (`prepare_builtin`, then meta.json)
    unless it already is. Safe when several processes call it at once on one machine (the
    workers of a run, each starting with it): the first prepares, the others wait on a lock
    file beside the folder, then find it prepared."""
    import fcntl

    folder = Path(folder)
    if (folder / "meta.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (released when the file closes)
        if not (folder / "meta.json").is_file():
            logger.info("tokenising the built-in corpus into %s (once)", folder)
            folder.mkdir(exist_ok=True)
            prepared = prepare_builtin(folder, tokenizer=tokenizer, max_bytes=max_bytes, vocab_size=vocab_size)
            write_meta(folder, prepared.tokenizer, TokenFile(prepared.train).header.vocab_size,
                       prepared.train_tokens, prepared.val_tokens,
                       source="built-in corpus (Python standard library sources)")
    return folder


def data_tokenizer(folder: str | Path) -> Tokenizer:
    """The tokenizer a prepared data folder was made with (its meta.json's, a relative
    path taken from the folder). Raises FileNotFoundError if it is missing."""
    folder = Path(folder)
    meta_path = folder / "meta.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{str(folder)!r} holds no meta.json; make it with `edgc prepare`")
    spec = json.loads(meta_path.read_text())["tokenizer"]
    if spec != "gpt2" and not Path(spec).is_absolute():
        spec = str(folder / spec)
    return load_tokenizer(spec)
