"""Training data: corpora, tokenizers, token files and batches."""

from edgc.data.corpus import (
    Corpus,
    CorpusSplit,
    builtin_corpus,
    iter_text_files,
    split_corpus,
)
from edgc.data.prepare import (
    PreparedData,
    builtin_folder,
    data_tokenizer,
    ensure_builtin,
    prepare,
    prepare_builtin,
    prepare_files,
    write_meta,
)
from edgc.data.stream import BatchStream, windows_at
from edgc.data.tokenizer import (
    BPETokenizer,
    GPT2Tokenizer,
    Tokenizer,
    gpt2_tokenizer,
    load_tokenizer,
    train_bpe_tokenizer,
)
from edgc.data.tokens import TokenFile, TokenFileHeader, get_batch, write_token_file

__all__ = [
    "BPETokenizer",
    "BatchStream",
    "Corpus",
    "CorpusSplit",
    "GPT2Tokenizer",
    "PreparedData",
    "TokenFile",
    "TokenFileHeader",
    "Tokenizer",
    "builtin_corpus",
    "builtin_folder",
    "data_tokenizer",
    "ensure_builtin",
    "get_batch",
    "gpt2_tokenizer",
    "iter_text_files",
    "load_tokenizer",
    "prepare",
    "prepare_builtin",
    "prepare_files",
    "split_corpus",
    "train_bpe_tokenizer",
    "windows_at",
    "write_meta",
    "write_token_file",
]
