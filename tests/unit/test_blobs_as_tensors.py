"""edgc train's checkpoints hold an FSDP state's bytes as uint8 tensors (written to the file
from their memory, not copied into the pickle stream); the state loads from either form."""

import io

import torch

from edgc.comm.replicas import blobs_as_tensors


def test_bytes_become_tensors_over_the_same_values_and_the_rest_is_kept():
    blob = bytes(range(256)) * 3
    entry = {"comm": {"format": "edgc-fsdp", "layout": [2, 2], "rank0": blob}, "n": 3, "list": [b"ab", b""]}
    out = blobs_as_tensors(entry)
    t = out["comm"]["rank0"]
    assert isinstance(t, torch.Tensor) and t.dtype == torch.uint8
    assert t.numpy().tobytes() == blob
    assert out["comm"]["format"] == "edgc-fsdp" and out["comm"]["layout"] == [2, 2] and out["n"] == 3
    assert out["list"][0].numpy().tobytes() == b"ab"
    empty = out["list"][1]  # (an empty tensor: a weights-only load refuses an empty bytes)
    assert isinstance(empty, torch.Tensor) and empty.dtype == torch.uint8 and empty.numpy().tobytes() == b""
    assert entry["comm"]["rank0"] is blob  # (the input is unchanged)
    buf = io.BytesIO()
    torch.save(out, buf)
    back = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)  # (as edgc loads them: no code)
    assert back["comm"]["rank0"].numpy().tobytes() == blob and back["list"][1].numel() == 0
