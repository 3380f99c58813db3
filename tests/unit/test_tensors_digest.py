"""edgc.comm.replicas.tensors_digest: how replicas are compared bit for bit."""

import torch

from edgc.comm.replicas import tensors_digest


def test_equal_tensors_give_equal_digests_and_one_flipped_bit_does_not():
    a = [torch.randn(4, 3), torch.arange(5, dtype=torch.float64)]
    same = [t.clone() for t in a]
    assert tensors_digest(a) == tensors_digest(same)
    flipped = [t.clone() for t in a]
    flipped[0].view(torch.int32)[2, 1] ^= 1  # the lowest mantissa bit of one float
    assert tensors_digest(flipped) != tensors_digest(a)
    # order counts, and a transposed (non-contiguous) view hashes as its values in order
    assert tensors_digest(a[::-1]) != tensors_digest(a)
    assert tensors_digest([a[0].t()]) == tensors_digest([a[0].t().contiguous()])
