import pytest

from edgc.data import prepare_builtin, write_meta


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A small slice of the built-in corpus with a 512-token local BPE, prepared once."""
    folder = tmp_path_factory.mktemp("data")
    prepared = prepare_builtin(folder, tokenizer="bpe", max_bytes=400_000, vocab_size=512)
    write_meta(folder, prepared.tokenizer, 512, prepared.train_tokens, prepared.val_tokens, source="test")
    return folder
