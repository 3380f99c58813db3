"""The run's batch stream (edgc.data.stream): the batches of each replica's own generator
while the number of replicas is the run's first, and every block read once, in order,
when it changes."""

import numpy as np
import pytest
import torch

from edgc.data import BatchStream, get_batch

TOKENS = np.arange(5000, dtype=np.uint16)  # (each id its own position: a window names its start)
B, T, SEED = 3, 16, 11


def _stream(sequences):
    return BatchStream(TOKENS, B, T, seed=SEED, sequences=sequences)


def _reference_blocks(count, sequences):
    """The first `count` blocks' start positions, by the definition: block b is drawn by
    generator b mod S, seeded SEED * 7919 + j, as its next block."""
    gens = [torch.Generator().manual_seed(SEED * 7919 + j) for j in range(sequences)]
    return [torch.randint(len(TOKENS) - T, (B,), generator=gens[b % sequences]) for b in range(count)]


def _starts(x):
    """The start positions of a batch's windows."""
    return x[:, 0].tolist()


@pytest.mark.parametrize("accum", [1, 3])
def test_at_the_first_number_of_replicas_each_replica_reads_its_own_generator(accum):
    # the batches edgc drew before the stream: get_batch on replica r's generator
    streams = [_stream(2) for _ in range(2)]
    gens = [torch.Generator().manual_seed(SEED * 7919 + r) for r in range(2)]
    for _ in range(4):
        for r in range(2):
            for x, y in streams[r].step(2, accum, r):
                ex, ey = get_batch(TOKENS, B, T, gens[r])
                assert torch.equal(x, ex) and torch.equal(y, ey)


def test_another_number_of_replicas_reads_every_block_once_in_order():
    # 2 replicas for 3 steps, then 1 replica of 2 micro-batches, then 4 replicas of 1:
    # the blocks read, in block order, are the stream's first ones, none twice, none passed over
    layout = [(2, 1)] * 3 + [(1, 2)] * 2 + [(4, 1)] * 2
    streams = {r: _stream(2) for r in range(4)}
    read = []
    for replicas, accum in layout:
        batches = [streams[r].step(replicas, accum, r) for r in range(replicas)]
        for r in range(replicas, 4):  # (the others' streams move on as if they had run)
            streams[r].step(replicas, accum, 0)
        for k in range(replicas * accum):  # block k of the step: micro-batch k // R of replica k % R
            x, y = batches[k % replicas][k // replicas]
            assert torch.equal(x[:, 1:], y[:, :-1])
            read.append(x)
    expected = _reference_blocks(len(read), 2)
    assert len(read) == 3 * 2 + 2 * 2 + 2 * 4
    for x, starts in zip(read, expected, strict=True):
        assert _starts(x) == starts.tolist()


def test_state_round_trip_and_a_checkpoint_of_replica_generators():
    a = _stream(2)
    for _ in range(3):
        a.step(2, 2, 0)
    b = _stream(2)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.step(1, 1, 0)[0][0], b.step(1, 1, 0)[0][0])
    # a checkpoint of before the stream: each replica's generator after 3 steps of 2 micro-batches
    gens = [torch.Generator().manual_seed(SEED * 7919 + r) for r in range(2)]
    for _ in range(3):
        for g in gens:
            for _ in range(2):
                get_batch(TOKENS, B, T, g)
    legacy = BatchStream.from_replica_generators(TOKENS, B, T, seed=SEED, states=[g.get_state() for g in gens],
                                                 step=3, accum=2)
    fresh = _stream(2)
    for _ in range(3):
        fresh.step(2, 2, 1)
    assert legacy.state_dict()["blocks"] == fresh.state_dict()["blocks"] == 12
    for _ in range(2):
        assert torch.equal(legacy.step(2, 2, 1)[1][0], fresh.step(2, 2, 1)[1][0])


def test_refusals():
    with pytest.raises(ValueError, match="interleaves 2 generators, this one 3"):
        _stream(3).load_state_dict(_stream(2).state_dict())
    with pytest.raises(ValueError, match="out of range"):
        _stream(2).step(2, 1, 2)
    with pytest.raises(ValueError, match="block_size"):
        BatchStream(TOKENS[:10], B, T, seed=SEED, sequences=1)
