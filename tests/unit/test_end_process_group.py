"""end_process_group frees the gloo group before the interpreter shuts down.

A group still alive at shutdown lets a gloo thread drop a finished collective's tensors
during finalisation, which aborts a worker whose work succeeded (1 run in ~12 of
`edgc bench comm` did, before workers freed their group this way).
"""

import logging
import weakref

import torch
import torch.distributed as dist

from edgc.train.launch import end_process_group


def _init(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)


def test_group_held_by_a_reference_cycle_is_freed(tmp_path):
    _init(tmp_path)
    t = torch.ones(4)
    dist.all_reduce(t)
    holder = {"group": dist.group.WORLD}
    holder["self"] = holder  # a cycle, as DDP, its reducer and a hook state make
    group = weakref.ref(holder["group"])
    del holder
    assert end_process_group() is True
    assert not dist.is_initialized()
    assert group() is None


def test_group_still_referenced_is_reported(tmp_path, caplog):
    _init(tmp_path)
    kept = dist.group.WORLD
    with caplog.at_level(logging.DEBUG, logger="edgc.train.launch"):
        assert end_process_group() is False
    assert "outlived destroy_process_group" in caplog.text
    assert not dist.is_initialized()
    del kept


def test_without_a_group_it_does_nothing():
    assert not dist.is_initialized()
    assert end_process_group() is True
