"""TorchPowerSGDState's checkpoints: torch's per-bucket error feedback and warm-start P/Q
saved per parameter, and rebuilt for whatever bucket layout the hook meets next (DDP
buckets a resumed job's first step differently from the step the checkpoint was taken at)."""

import io

import pytest
import torch

from edgc.comm.baselines import TorchPowerSGDState, torch_powersgd_hook
from edgc.comm.buckets import FlatBucket

# matrices torch compresses at rank 2 (two of one shape, a 3-D one viewed as (4, 6)) and
# vectors it sends whole
SHAPES = [(8, 6), (8, 6), (5,), (6, 8), (8, 6), (4, 3, 2), (7,)]
SAVED = [[0, 1, 2], [3, 4, 5, 6]]  # the layout the buffers are saved in
OTHER = [[6, 2, 0], [5], [4, 3, 1]]  # another bucket count and order, as DDP may choose


def _module():
    torch.manual_seed(0)
    return torch.nn.ParameterList([torch.nn.Parameter(torch.randn(s, dtype=torch.float64)) for s in SHAPES])


def _state(module):
    return TorchPowerSGDState(None, rank=2, start_iter=2, min_compression_rate=1.0, module=module)


def _grads(step):
    g = torch.Generator().manual_seed(step)
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]


def _step(state, module, layout, grads):
    """One step of the hook over buckets in `layout`; returns each parameter's result."""
    params = list(module.parameters())
    out = {}
    for b, idx in enumerate(layout):
        buf = torch.cat([grads[i].reshape(-1) for i in idx])
        fut = torch_powersgd_hook(state, FlatBucket(b, buf, [params[i] for i in idx], b == len(layout) - 1))
        # wait for the bucket's whole chain (torch's callbacks run on gloo's thread) before
        # reading it or starting the next: value() on a future still running can race it
        result = fut.wait()
        offset = 0
        for i in idx:
            n = params[i].numel()
            out[i] = result[offset:offset + n].view(params[i].shape).clone()
            offset += n
    return out


def _per_param(flat_by_bucket, layout):
    """Cut torch's error buffers per parameter, by the offsets of `layout` (computed here)."""
    out = {}
    for b, idx in enumerate(layout):
        offset = 0
        for i in idx:
            n = torch.Size(SHAPES[i]).numel()
            out[i] = flat_by_bucket[b][offset:offset + n].view(SHAPES[i])
            offset += n
    return out


def _roundtrip(d, weights_only=True):
    """`d` through a file, loaded as edgc loads files (only tensors and plain values)."""
    buf = io.BytesIO()
    torch.save(d, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=weights_only)


def test_saved_error_feedback_is_per_parameter_and_rebuilt_for_another_layout(one_process_group):
    module = _module()
    a = _state(module)
    for step in range(4):
        _step(a, module, SAVED, _grads(step))
    assert a.inner.iter == 4 and len(a.inner.error_dict) == 2
    original = _per_param(a.inner.error_dict, SAVED)
    saved = _roundtrip(a.state_dict())
    assert saved["version"] == 3 and not any(saved["inner"].get(k) for k in ("error_dict", "q_memory_dict"))
    assert sorted(saved["params"]["error"]) == list(range(len(SHAPES)))
    for i, e in original.items():
        assert torch.equal(saved["params"]["error"][i], e)
    assert sorted(saved["params"]["q"]) == [0, 1, 3, 4, 5]  # the compressed matrices: Q of (m, r)
    assert [tuple(saved["params"]["q"][i].shape) for i in (0, 3, 5)] == [(6, 2), (8, 2), (6, 2)]

    b = _state(module)
    b.load_state_dict(saved)
    params = list(module.parameters())
    for k, idx in enumerate(OTHER):
        n = sum(params[i].numel() for i in idx)
        b.before_bucket(FlatBucket(k, torch.zeros(n, dtype=torch.float64), [params[i] for i in idx], False))
        assert torch.equal(b.inner.error_dict[k], torch.cat([original[i].reshape(-1) for i in idx]))
    assert b._pending is None  # everything placed


def test_resumed_state_in_another_layout_repeats_the_uninterrupted_steps(one_process_group):
    module = _module()
    a = _state(module)
    for step in range(4):
        _step(a, module, SAVED, _grads(step))
    b = _state(module)
    b.load_state_dict(_roundtrip(a.state_dict()))
    # a goes on in its layout; b's first step has another (a resumed job's first step), then
    # b goes back to a's (DDP's rebuild after that step)
    for step, layout in zip(range(4, 8), [OTHER, SAVED, SAVED, SAVED], strict=True):
        want, got = _step(a, module, SAVED, _grads(step)), _step(b, module, layout, _grads(step))
        for i in want:
            assert torch.equal(got[i], want[i]), (step, i)
    for i, e in _per_param(a.inner.error_dict, SAVED).items():
        assert torch.equal(_per_param(b.inner.error_dict, SAVED)[i], e)
    assert (b.inner.iter, b.step, b.bytes_sent) == (a.inner.iter, a.step, a.bytes_sent)


def test_without_remapping_the_first_step_in_another_layout_differs(one_process_group):
    # what the fix is for: torch's buffers applied as saved, by bucket index, in another layout
    module = _module()
    a = _state(module)
    for step in range(4):
        _step(a, module, SAVED, _grads(step))
    raw = _state(None)  # not bound: torch's hook alone, with a's buffers by bucket index
    raw.inner.__setstate__(a.inner.__getstate__())
    reordered = [[1, 0, 2], [4, 3, 6, 5]]  # same buckets, same sizes, other order
    want, got = _step(a, module, SAVED, _grads(4)), _step(raw, module, reordered, _grads(4))
    assert not all(torch.equal(got[i], want[i]) for i in want)


def test_old_per_bucket_checkpoints_load_before_compression_and_are_refused_after(one_process_group):
    module = _module()
    a = _state(module)
    _step(a, module, SAVED, _grads(0))  # (warm-up: nothing in torch's buffers yet)
    old = {"format": "torch-powersgd-state", "world_size": 1,
           "inner": {k: v for k, v in a.inner.__getstate__().items()}, "last_step_rank": 0, "step": 1,
           "bytes_sent": 0, "bytes_uncompressed": 0, "comm_seconds": 0.0}
    b = _state(module)
    b.load_state_dict(old)
    assert (b.inner.iter, b.step) == (1, 1)
    for step in range(1, 4):
        _step(a, module, SAVED, _grads(step))
    old["inner"] = {k: v for k, v in a.inner.__getstate__().items()}
    with pytest.raises(ValueError, match="older edgc.*cannot be resumed exactly"):
        _state(module).load_state_dict(old)
    with pytest.raises(ValueError, match="version 7"):
        _state(module).load_state_dict({**a.state_dict(), "version": 7})


def test_torchs_numpy_generator_is_saved_as_plain_values_and_version_2_still_loads(one_process_group):
    # torch's PowerSGDState keeps a numpy RandomState, which a weights-only load refuses;
    # version 3 saves its state as a tensor and numbers, and a version-2 state (the object
    # itself, from a file loaded with trust) still loads
    module = _module()
    a = _state(module)
    for step in range(4):
        _step(a, module, SAVED, _grads(step))
    a.inner.rng.standard_normal()  # (a cached Gaussian too: every part of the state travels)
    saved = _roundtrip(a.state_dict())
    assert isinstance(saved["inner"]["rng"], dict) and isinstance(saved["inner"]["rng"]["keys"], torch.Tensor)
    old = _roundtrip({**a.state_dict(), "version": 2, "inner": {**a.state_dict()["inner"], "rng": a.inner.rng}},
                     weights_only=False)
    want = a.inner.rng.randint(1_000_000_000, size=5).tolist()
    for d in (saved, old):
        b = _state(module)
        b.load_state_dict(d)
        assert b.inner.rng.randint(1_000_000_000, size=5).tolist() == want


def test_saved_state_must_fit_the_module(one_process_group):
    module = _module()
    a = _state(module)
    for step in range(4):
        _step(a, module, SAVED, _grads(step))
    saved = a.state_dict()
    other = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))])
    with pytest.raises(ValueError, match="parameter 1; the module has 1|shape"):
        _state(other).load_state_dict(saved)
    with pytest.raises(RuntimeError, match="needs the module"):
        _state(None).load_state_dict(saved)
