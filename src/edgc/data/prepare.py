"""Turn text into token files: user-given files and folders, or the built-in corpus.

Each document (one text file) is encoded and followed by the tokenizer's end-of-text id,
as in GPT-2's training data. Files are read and encoded a batch at a time and the ids
streamed to disk, so memory holds one batch of text, not the corpus.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from edgc.data.corpus import (
    DEFAULT_VAL_FRACTION,
    builtin_corpus,
    iter_text_files,
    read_text,
    split_corpus,
)
from edgc.data.tokenizer import Tokenizer, load_tokenizer, train_bpe_tokenizer
from edgc.data.tokens import TokenFileHeader, write_token_file

logger = logging.getLogger(__name__)

__all__ = ["PreparedData", "prepare", "prepare_builtin"]

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
    """Spec to pass to `load_tokenizer`: "gpt2", or the path of the saved BPE JSON."""

    train_tokens: int
    val_tokens: int


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
    val_fraction: float = DEFAULT_VAL_FRACTION,
) -> PreparedData:
    """Builds `train.bin` and `val.bin` in `out_dir` from the built-in corpus (the
    standard library's sources, at most `max_bytes` of them; see `builtin_corpus`),
    split by file so the two share no document.

    With tokenizer="bpe", first trains a byte-level BPE of `vocab_size` tokens on the
    train split only and saves it as `out_dir/tokenizer.json`; otherwise `tokenizer` is
    a spec for `load_tokenizer` (e.g. "gpt2") and `vocab_size` is unused. Overwrites
    existing outputs. Returns their paths and token counts.
    """
    out_dir = Path(out_dir)
    start = time.perf_counter()
    split = split_corpus(builtin_corpus(max_bytes), val_fraction)
    if tokenizer == "bpe":
        tok: Tokenizer = train_bpe_tokenizer(split.train.texts(), vocab_size=vocab_size)
        spec = str(tok.save(out_dir / "tokenizer.json"))
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
