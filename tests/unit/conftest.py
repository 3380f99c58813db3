"""Fixtures of the single-process unit tests."""

import pytest
import torch.distributed as dist


@pytest.fixture
def one_process_group(tmp_path):
    """A gloo process group of one rank (a file store in tmp_path), for tests of a hook or
    state that needs a group but no peers."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
