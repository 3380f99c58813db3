"""DAC at run time: T(r) fits, DACConfig, one stage's decision, and the GPT split."""

import itertools
import math

import pytest
import torch

from edgc.comm.collectives import Collectives
from edgc.comm.pipeline import StageAlignment
from edgc.models import build_model
from edgc.policy.dac import DACConfig, TimeModel, dac_ranks, stage_rank
from edgc.train.pipeline import split_gpt, stage_blocks


def test_linear_fit_recovers_a_line_and_through_origin_with_one_rank():
    samples = [(r, 0.002 * r + 0.01) for r in (8, 16, 32) for _ in range(3)]
    m = TimeModel.fit(samples, "linear")
    assert m.eta == pytest.approx(0.002) and m.intercept == pytest.approx(0.01)
    assert m(24) == pytest.approx(0.058)
    one = TimeModel.fit([(16, 0.032), (16, 0.036)], "linear")  # the paper's T = eta * r
    assert one.intercept == 0.0 and one(32) == pytest.approx(0.068)


def test_fits_are_non_decreasing_even_on_noisy_decreasing_data():
    samples = [(8, 0.05), (16, 0.04), (32, 0.03)]  # noise: bigger rank measured faster
    for method in ("linear", "interp"):
        m = TimeModel.fit(samples, method)
        values = [m(r) for r in range(1, 65)]
        assert all(b >= a for a, b in itertools.pairwise(values)), method


def test_interp_goes_through_the_means_and_extends_both_ends():
    m = TimeModel.fit([(8, 0.02), (8, 0.04), (16, 0.05), (32, 0.09)], "interp")
    assert m(8) == pytest.approx(0.03) and m(16) == pytest.approx(0.05) and m(32) == pytest.approx(0.09)
    assert m(24) == pytest.approx(0.07)
    assert m(4) == pytest.approx(0.015)  # through the origin below the first point
    assert m(48) == pytest.approx(0.13)  # the last segment's slope above the last point
    assert TimeModel.from_dict(m.to_dict()) == m


def test_fit_rejects_no_samples_and_unknown_method():
    with pytest.raises(ValueError, match="at least one"):
        TimeModel.fit([], "linear")
    with pytest.raises(ValueError, match="time model"):
        TimeModel.fit([(4, 1.0)], "cubic")


@pytest.mark.parametrize("bad, match", [
    ({"stage_ranks": "max"}, "stage_ranks"), ({"time_model": "spline"}, "time_model"),
    ({"eta": -1.0}, "eta"), ({"t_mb": math.nan}, "t_mb"), ({"multiple": 0}, "multiple"),
    ({"bogus": 1}, "unknown DAC option"),
])
def test_dac_config_rejects_bad_values_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        DACConfig.from_dict(bad)


def test_stage_rank_is_dac_ranks_one_stage_at_a_time():
    t = TimeModel.given(0.5, 1.0)
    full = dac_ranks(t, 8, 3.0, 4, 32, 100.0)
    t0 = t(8)
    assert [stage_rank(p, t, 8, t0, 3.0, 32, 100.0) for p in range(4)] == full == [8, 16, 20, 28]


def _decide(alignment, r_max, r_entropy, step, applied_rank=8, r_min=2, stage_uncompressed=False):
    """StageAlignment.decide in one process (its collectives skipped, as with one replica)."""
    current = None if stage_uncompressed else applied_rank
    return alignment.decide(Collectives(), r_entropy, step, current=current, r_min=r_min, r_max=r_max)


def test_alignment_single_stage_decisions_follow_the_rule():
    # a 1-process "pipeline group" carries this stage's own numbers: stage 1 sees T0 = 0, r0 = 0
    a = StageAlignment(1, 2, None, DACConfig(t_mb=0.0035, t_uncompressed=1.0))
    for r, t in [(8, 0.008), (16, 0.016), (32, 0.032)]:
        a.observe_compressed(r, t)
    assert _decide(a, 32, 8, 10) == 4  # T(r) = 1 ms * r >= 3.5 ms at r = 4
    d = a.decisions[-1]
    assert (d["stage"], d["r0"], d["t0"], d["t_mb"], d["local"], d["rank"]) == (1, 0, 0.0, 0.0035, 4, 4)
    uniform = StageAlignment(0, 2, None, DACConfig(stage_ranks="uniform"))
    uniform.observe_compressed(16, 0.02)
    assert _decide(uniform, 32, 12, 10) == 12
    # stage 0 goes uncompressed when T(r0) reaches the uncompressed time
    s0 = StageAlignment(0, 2, None, DACConfig(eta=0.01, t_uncompressed=0.1))
    assert _decide(s0, 32, 8, 5) == 8
    assert _decide(s0, 32, 12, 10) is None
    restored = StageAlignment(0, 2, None, DACConfig(eta=0.01, t_uncompressed=0.1))
    restored.load_state_dict(s0.state_dict())
    assert restored.decisions == s0.decisions
    with pytest.raises(ValueError, match="stage 0 of 2"):
        StageAlignment(1, 2, None).load_state_dict(s0.state_dict())


def test_measured_slack_spends_the_observed_wait():
    a = StageAlignment(1, 2, None, DACConfig(slack="measured", eta=0.001, t_uncompressed=1.0))
    for w in (0.005, 0.007):  # stage 1 waited 6 ms for stage 0 on average
        a.observe_wait(w)
    # budget = T(8) + 6 ms = 14 ms -> rank 14 -> 16; the waits are cleared for the next window
    assert _decide(a, 32, 8, 10, applied_rank=8) == 16
    assert a.decisions[-1]["budget"] == pytest.approx(0.014) and a.waits == []
    # no wait: it keeps its time; a stage that was uncompressed starts from that time
    assert _decide(a, 32, 8, 20, applied_rank=12) == 12
    assert _decide(a, 32, 8, 30, stage_uncompressed=True) is None


def test_alignment_measures_t_mb_and_keeps_recent_samples():
    a = StageAlignment(0, 2, None, DACConfig(max_samples=3))
    assert a.time_model() is None and a.t_mb() == 0.0 and a.t_uncompressed() == math.inf
    for t in (1.0, 2.0, 3.0, 4.0):
        a.observe_backward(t)
        a.observe_uncompressed(t)
    assert a.t_mb() == 3.0 and a.t_uncompressed() == 3.0


def test_stage_blocks_cover_every_block_once():
    assert stage_blocks(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_blocks(6, 4) == [range(0, 1), range(1, 2), range(2, 4), range(4, 6)]
    with pytest.raises(ValueError, match="cannot split"):
        stage_blocks(2, 3)


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_split_gpt_computes_what_the_whole_model_does(stages):
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=128, block_size=16)
    idx = torch.randint(0, 128, (2, 16))
    want, _ = model(idx)
    parts = split_gpt(model, stages)
    x = idx
    for part in parts:
        x = part(x)
    torch.testing.assert_close(x, want, rtol=0, atol=0)
    # the head holds its own copy of the tied embedding, equal but not shared
    assert torch.equal(parts[-1].lm_head.weight, parts[0].wte.weight)
    assert parts[-1].lm_head.weight is not parts[0].wte.weight
    n_whole = sum(p.numel() for p in model.parameters())
    n_split = sum(p.numel() for part in parts for p in part.parameters())
    assert n_split == n_whole + model.wte.weight.numel()


def test_stage_sent_uncompressed_by_dac_sends_its_residual_first():
    """float64: compressed step: sent + new residual = gradient + old residual; the first
    uncompressed step then sends gradient + residual and leaves the residual at zero."""
    from edgc.comm import EDGCState, edgc_hook
    from edgc.comm.buckets import sync_with_hook
    from edgc.config import EDGCConfig

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(16, 12, dtype=torch.float64)),
              torch.nn.Parameter(torch.zeros(12, dtype=torch.float64))]
    cfg = EDGCConfig(policy="static", max_rank=2, min_rank=2, warmup_steps=1, warmup="fixed", window=2,
                     iteration_sample_rate=1.0)
    state = EDGCState(None, cfg, alignment=StageAlignment(0, 2, None, DACConfig(eta=1.0, t_uncompressed=0.5)))

    def step():
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        sync_with_hook(params, state, edgc_hook, cap_bytes=2**20)
        state.align()
        return grads

    step()  # warm-up: plain
    (g,) = [group for group in state.sync.compression.groups.values()]
    before = g.error.clone()
    raw = step()  # compressed at rank 2; window end: T(2) = 2 s >= 0.5 s, so uncompressed next
    torch.testing.assert_close(params[0].grad + g.error[0], raw[0] + before[0], rtol=0, atol=1e-12)
    assert state.sync.stage_uncompressed and state.rank == 0
    residual = g.error[0].clone()
    assert residual.abs().max() > 0
    raw = step()  # uncompressed, with the residual
    torch.testing.assert_close(params[0].grad, raw[0] + residual, rtol=0, atol=1e-12)
    torch.testing.assert_close(params[1].grad, raw[1], rtol=0, atol=0)
    assert g.error.abs().max() == 0


def test_activation_compressor_sends_plus_keeps_what_it_was_given():
    """float64: P Qᵀ + new residual = gradient + old residual, per micro-batch slot;
    full rank is exact; the state round-trips."""
    from edgc.comm.activation import ActivationGradCompressor, Carrier

    torch.manual_seed(0)
    c = ActivationGradCompressor(3, seed=1)
    grads = [torch.randn(2, 6, 5, dtype=torch.float64) for _ in range(2)]
    for _ in range(3):
        c.start_step()
        for slot, g in enumerate(grads):
            old = c.errors[slot].clone() if slot < len(c.errors) else torch.zeros_like(g)
            packed = c.compress(g)
            assert packed.shape == (2, 6 + 5, 3)
            sent = Carrier.backward(type("Ctx", (), {"t": 6})(), packed)[0]
            torch.testing.assert_close(sent + c.errors[slot], g + old, rtol=0, atol=1e-12)
    assert c.bytes_sent == 6 * 2 * 11 * 3 * 8 and c.bytes_uncompressed == 6 * 2 * 30 * 8
    full = ActivationGradCompressor(5)
    full.start_step()
    g = grads[0]
    packed = full.compress(g)
    torch.testing.assert_close(packed[:, :6] @ packed[:, 6:].transpose(1, 2), g, rtol=0, atol=1e-12)
    again = ActivationGradCompressor(3)
    again.load_state_dict(c.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(again.errors, c.errors, strict=True))
    with pytest.raises(ValueError, match="rank"):
        ActivationGradCompressor(4).load_state_dict(c.state_dict())
