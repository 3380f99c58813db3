"""A compressed step keeps one error buffer, updated in place, and no temporary larger
than one unit's matrices of one shape: M is written into the gradient (float32 and float64
gradients), and read there as one batch where the matrices lie at one stride, or gathered
into the compression state's workspace, emptied at the step's end. The
numbers are those of the PowerSGD round (edgc.compress) step after step, and a non-finite
unit leaves its error as it was."""

import pytest
import torch

from edgc import EDGCConfig
from edgc.comm.sync import GradientSync
from edgc.comm.workspace import Workspace
from edgc.compress import error_feedback_, orthogonalize_, project_p, project_q, reconstruct

# module 0: two (8, 6) matrices (one part of B' = 2: M_hat in the workspace) and a bias;
# module 1: one (5, 7) matrix (B' = 1: M_hat straight into the gradient)
LAYOUT = [[("a", (8, 6)), ("b", (8, 6)), ("bias", (6,))], [("c", (5, 7))]]
STATIC = dict(policy="static", max_rank=2, warmup="fixed", warmup_steps=1, min_compression_rate=1.0)


def test_a_workspace_hands_out_views_of_one_buffer_grown_to_the_largest_request():
    ws = Workspace()
    a = ws.take("x", (2, 3), torch.float64, torch.device("cpu"))
    b = ws.take("x", (5,), torch.float64, torch.device("cpu"))
    assert a.shape == (2, 3) and b.shape == (5,) and a.data_ptr() == b.data_ptr()
    c = ws.take("x", (4, 4), torch.float64, torch.device("cpu"))  # larger: a new buffer
    assert c.is_contiguous() and ws.take("x", (2, 3), torch.float64, "cpu").data_ptr() == c.data_ptr()
    assert ws.take("y", (2, 3), torch.float64, "cpu").data_ptr() != c.data_ptr()
    assert ws.nbytes == (16 + 6) * 8


def _grads(step):
    g = torch.Generator().manual_seed(step)
    return [torch.randn(sum(torch.Size(s).numel() for _, s in entries), dtype=torch.float64, generator=g)
            for entries in LAYOUT]


def _step(sync, step, spoil=False):
    """One eager step (every buffer its own unit); returns the averaged buffers."""
    out = []
    for i, flat in enumerate(_grads(step)):
        if spoil and i == 1:
            flat[0] = float("inf")
        fut = torch.futures.Future()
        sync.receive(flat, LAYOUT[i], fut, i == len(LAYOUT) - 1)
        out.append(fut.wait())
    return out


def _expected(group, grads):
    """The PowerSGD round of one group on one replica: (M_hat, new error), from its Q and
    error before the step."""
    m = torch.stack(grads) + group.error
    p = orthogonalize_(project_p(m, group.q))
    q = project_q(m, p)
    m_hat = reconstruct(p, q)
    return m_hat, error_feedback_(m.clone(), m_hat)


@pytest.mark.parametrize("state_dtype", ["native", "bf16"])
def test_steps_update_one_error_buffer_in_place_and_give_the_round_s_numbers(state_dtype):
    sync = GradientSync(None, EDGCConfig(**STATIC, state_dtype=state_dtype), eager=True)
    sync.declare(LAYOUT, [torch.float64, torch.float64])
    _step(sync, 1)  # warm-up: sent whole
    groups = sync.compression.groups
    assert len(groups) == 2
    pointers, peaks = [], []
    clear = sync.compression.workspace.clear

    def spy():  # the workspace's size at the step's end, just before it is emptied
        peaks.append(sync.compression.workspace.nbytes)
        clear()

    sync.compression.workspace.clear = spy
    for step in (2, 3, 4, 5):
        before = {k: (g.q.clone(), g.error.clone()) for k, g in groups.items()}
        grads = _grads(step)
        out = _step(sync, step)
        for key, g in groups.items():
            q, error = before[key]
            if key[0] == 8:  # a and b: module 0, offsets 0 and 48
                mats, got = [grads[0][:48].view(8, 6), grads[0][48:96].view(8, 6)], out[0][:96].view(2, 8, 6)
            else:
                mats, got = [grads[1].view(5, 7)], out[1].view(1, 5, 7)
            ref = type(g)(g.shape, g.slots, q.double(), error.double(), g.dtype)
            m_hat, new_error = _expected(ref, mats)
            torch.testing.assert_close(got, m_hat, rtol=1e-12, atol=1e-12)
            if state_dtype == "native":
                torch.testing.assert_close(g.error, new_error, rtol=1e-12, atol=1e-12)
            else:  # (kept in bf16: Q and the error rounded as they are kept)
                torch.testing.assert_close(g.error, new_error.to(torch.bfloat16), rtol=0.01, atol=1e-2)
        pointers.append({k: g.error.data_ptr() for k, g in groups.items()})
    # one error buffer per group, updated in place; float64 gradients hold M themselves, and
    # each module's matrices of one shape lie at one stride in its buffer, so the round works
    # on them as one batch where they lie: no workspace at all
    assert all(p == pointers[0] for p in pointers)
    assert peaks == [0] * 4
    assert sync.compression.workspace.nbytes == 0
    assert sync.stats().compressed_steps == 4


def test_a_nonfinite_unit_keeps_its_error_and_the_step_keeps_q():
    # eager (edgc.fsdp): each buffer is averaged before its call returns, so only a unit
    # whose sums (or an earlier unit's) were non-finite keeps its error as it was; module 0,
    # finite and averaged first, keeps its new error; Q is kept only for a finite step
    sync = GradientSync(None, EDGCConfig(**STATIC), eager=True)
    sync.declare(LAYOUT, [torch.float64, torch.float64])
    for step in (1, 2):
        _step(sync, step)
    kept = {k: (g.error.data_ptr(), g.error.clone(), g.q.clone()) for k, g in sync.compression.groups.items()}
    ref = GradientSync(None, EDGCConfig(**STATIC), eager=True)
    ref.declare(LAYOUT, [torch.float64, torch.float64])
    for step in (1, 2, 3):
        _step(ref, step)
    _step(sync, 3, spoil=True)
    assert sync.stats().nonfinite_steps == 1
    for k, g in sync.compression.groups.items():
        ptr, error, q = kept[k]
        assert g.error.data_ptr() == ptr and torch.equal(g.q, q)
        assert torch.equal(g.error, ref.compression.groups[k].error if k[0] == 8 else error)


def test_a_state_dict_for_serialising_at_once_holds_the_live_tensors():
    sync = GradientSync(None, EDGCConfig(**STATIC), eager=True)
    sync.declare(LAYOUT, [torch.float64, torch.float64])
    for step in (1, 2):
        _step(sync, step)
    live = [g.error for g in sync.compression.groups.values()]
    copied = [g["error"] for g in sync.state_dict()["compression"]["groups"]]
    shared = [g["error"] for g in sync.state_dict(copy=False)["compression"]["groups"]]
    assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr() for a, b in zip(live, copied, strict=True))
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(live, shared, strict=True))
