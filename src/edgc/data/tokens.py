"""Token files: a tokenised corpus on disk, and random training batches drawn from it.

File layout (one file, so that it is written and replaced atomically as a whole):

    bytes [0, 1024)   header: the line "EDGC-TOKENS", then one line of JSON
                      {"version", "dtype", "count", "vocab_size", "tokenizer"},
                      padded with spaces; `head -c 1024 train.bin` shows it
    bytes [1024, ...) `count` token ids, little-endian uint16 (uint32 if the
                      vocabulary has more than 65536 ids), no separators

The ids are read through a numpy memmap, so opening even a large file loads nothing.
Like nanoGPT's train.bin, documents are simply concatenated with an end-of-text id
between them, and a training sample is any window of block_size + 1 consecutive ids.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgc.atomic import atomic_write
from edgc.data.stream import windows_at

logger = logging.getLogger(__name__)

__all__ = ["TokenFile", "TokenFileHeader", "write_token_file", "get_batch"]

_MAGIC = b"EDGC-TOKENS\n"
HEADER_BYTES = 1024
FORMAT_VERSION = 1
_DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_WRITE_CHUNK = 1 << 20  # ids buffered before a write when the input is a stream of ints


@dataclass(frozen=True)
class TokenFileHeader:
    """What a token file's header records."""

    dtype: str
    """"uint16" or "uint32"."""

    count: int
    """Number of token ids in the file."""

    vocab_size: int
    """Every id is below this."""

    tokenizer: str
    """Name of the tokenizer that produced the ids (`Tokenizer.name`)."""

    def encode(self) -> bytes:
        """Returns the header as exactly HEADER_BYTES bytes."""
        body = json.dumps({"version": FORMAT_VERSION, **asdict(self)}, sort_keys=True)
        raw = _MAGIC + body.encode("utf-8")
        if len(raw) + 1 > HEADER_BYTES:
            raise ValueError(f"token file header is {len(raw) + 1} bytes, more than {HEADER_BYTES}")
        return raw + b" " * (HEADER_BYTES - len(raw) - 1) + b"\n"


def _dtype_for(vocab_size: int) -> str:
    """Returns the narrowest supported dtype that holds ids 0 .. vocab_size - 1."""
    if vocab_size <= 2**16:
        return "uint16"
    if vocab_size <= 2**32:
        return "uint32"
    raise ValueError(f"vocab_size {vocab_size} does not fit in uint32 token ids")


def _as_chunks(token_ids: Iterable[int | Sequence[int] | np.ndarray]) -> Iterator[np.ndarray]:
    """Yields 1-D int64 arrays from a stream whose items are ids or sequences of ids
    (lists, numpy arrays, CPU tensors), keeping the order."""
    pending: list[int] = []
    for item in token_ids:
        if isinstance(item, (int, np.integer)):
            pending.append(int(item))
            if len(pending) >= _WRITE_CHUNK:
                yield np.asarray(pending, dtype=np.int64)
                pending = []
            continue
        if pending:
            yield np.asarray(pending, dtype=np.int64)
            pending = []
        chunk = np.asarray(item)
        if chunk.ndim != 1:
            raise ValueError(f"token id chunks must be 1-D, got shape {chunk.shape}")
        if chunk.size and not np.issubdtype(chunk.dtype, np.integer):
            raise ValueError(f"token ids must be integers, got dtype {chunk.dtype}")
        yield chunk.astype(np.int64, copy=False)
    if pending:
        yield np.asarray(pending, dtype=np.int64)


def write_token_file(
    token_ids: Iterable[int | Sequence[int] | np.ndarray],
    out_path: str | Path,
    *,
    vocab_size: int,
    tokenizer_name: str,
) -> TokenFileHeader:
    """Writes token ids to a token file, streaming: `token_ids` may be ids, or chunks of
    ids (e.g. one list per document), and is consumed once.

    The file appears at `out_path` only when complete (written to a temporary file, then
    renamed); on error any previous file there is left untouched. Returns the header
    written. Raises ValueError for an id outside [0, vocab_size).
    """
    dtype = _dtype_for(vocab_size)
    count = 0
    with atomic_write(out_path) as f:
        f.write(b"\0" * HEADER_BYTES)  # placeholder until the count is known
        for chunk in _as_chunks(token_ids):
            if chunk.size == 0:
                continue
            lo, hi = int(chunk.min()), int(chunk.max())
            if lo < 0 or hi >= vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(
                    f"token id {bad} at or after position {count} is outside "
                    f"[0, vocab_size={vocab_size})"
                )
            f.write(chunk.astype(_DTYPES[dtype]).tobytes())
            count += chunk.size
        header = TokenFileHeader(
            dtype=dtype, count=count, vocab_size=vocab_size, tokenizer=tokenizer_name
        )
        f.seek(0)
        f.write(header.encode())
    logger.info("wrote %d tokens (%s, %s) to %s", count, dtype, tokenizer_name, out_path)
    return header


class TokenFile:
    """A token file opened for reading. `tokens` is a read-only 1-D numpy memmap of the
    ids, so nothing is loaded until it is indexed.

    Raises FileNotFoundError if the file is missing, and ValueError naming the file and
    the problem if it is not a token file, has a damaged header, or is truncated.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(
                f"token file {str(self.path)!r} does not exist; create it with "
                f"edgc.data.prepare or prepare_builtin"
            )
        self.header = self._read_header()
        dtype = _DTYPES[self.header.dtype]
        expected = HEADER_BYTES + self.header.count * dtype.itemsize
        actual = self.path.stat().st_size
        if actual != expected:
            raise ValueError(
                f"token file {str(self.path)!r} is truncated or corrupt: its header promises "
                f"{self.header.count} {self.header.dtype} ids, i.e. {HEADER_BYTES} + "
                f"{self.header.count} * {dtype.itemsize} = {expected} bytes, but it has "
                f"{actual}; prepare it again"
            )
        if self.header.count == 0:
            self.tokens: np.ndarray = np.empty(0, dtype=dtype)  # mmap cannot map 0 bytes
        else:
            self.tokens = np.memmap(
                self.path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(self.header.count,)
            )

    def _read_header(self) -> TokenFileHeader:
        with open(self.path, "rb") as f:
            raw = f.read(HEADER_BYTES)

        def corrupt(why: str) -> ValueError:
            return ValueError(f"{str(self.path)!r} is not a valid token file: {why}")

        if len(raw) < HEADER_BYTES:
            raise corrupt(f"it is {len(raw)} bytes, shorter than the {HEADER_BYTES}-byte header")
        if not raw.startswith(_MAGIC):
            raise corrupt(f"it does not start with {_MAGIC!r}")
        try:
            fields = json.loads(raw[len(_MAGIC):].decode("utf-8"))
            version = fields.pop("version")
            header = TokenFileHeader(**fields)
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise corrupt(f"its header cannot be parsed ({e})") from e
        if version != FORMAT_VERSION:
            raise corrupt(f"format version {version}, this code reads {FORMAT_VERSION}")
        if header.dtype not in _DTYPES:
            raise corrupt(f"unknown dtype {header.dtype!r}")
        if not isinstance(header.count, int) or header.count < 0:
            raise corrupt(f"bad token count {header.count!r}")
        if not isinstance(header.vocab_size, int) or header.vocab_size <= 0:
            raise corrupt(f"bad vocab_size {header.vocab_size!r}")
        return header

    @property
    def vocab_size(self) -> int:
        return self.header.vocab_size

    @property
    def tokenizer_name(self) -> str:
        return self.header.tokenizer

    def __len__(self) -> int:
        return self.header.count

    def __repr__(self) -> str:
        return f"TokenFile({str(self.path)!r}, {self.header})"


def get_batch(
    tokens: np.ndarray | TokenFile,
    batch_size: int,
    block_size: int,
    generator: torch.Generator,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples `batch_size` random windows of `block_size + 1` consecutive ids.

    Returns (x, y), int64 tensors of shape (B, T) = (batch_size, block_size) on `device`,
    where y is x shifted left by one: y[b, t] is the id that follows x[b, t]. The start
    positions come from `generator` (a CPU torch.Generator), so the batch is a function
    of the generator's state, which this call advances; the global RNG is untouched.
    Raises ValueError if there are fewer than block_size + 1 ids.
    """
    data = tokens.tokens if isinstance(tokens, TokenFile) else tokens
    if len(data) < block_size + 1:
        raise ValueError(
            f"need at least block_size + 1 = {block_size + 1} tokens for one sample, "
            f"have {len(data)}"
        )
    starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator)  # (B,)
    return windows_at(data, starts, block_size, device)
