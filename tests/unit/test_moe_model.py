"""The mixture-of-experts model (edgc.models.moe) on one process, float64 where exactness
is claimed, and the refusals of an expert-parallel layout."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from edgc.cli import main
from edgc.models.gpt2 import GPT, PRESETS, GPTConfig, build_model
from edgc.models.moe import MoE
from edgc.moe import _expert_major, busiest_share, expert_parameter_names, load_counts
from edgc.train.config import TrainConfig


def _moe(bias=True):
    torch.manual_seed(0)
    moe = MoE(n_embd=8, n_expert=4, top_k=2, width=12, bias=bias, dropout=0.0).double()
    moe.init_weights(0.5, 0.5)
    with torch.no_grad():
        for b in (moe.experts.b_fc, moe.experts.b_proj):
            if b is not None:
                b.normal_()
    return moe


def _by_token(moe, x):
    """Each token through its top-k experts, one at a time, as the definition reads."""
    e = moe.experts
    out = []
    for t in x.reshape(-1, x.shape[-1]):
        p = moe.router(t).softmax(-1)
        w, ids = p.topk(moe.top_k)
        w = w / w.sum()
        y = torch.zeros_like(t)
        for wi, i in zip(w, ids.tolist(), strict=True):
            h = F.gelu(e.w_fc[i] @ t + e.b_fc[i], approximate="tanh")
            y = y + wi * (e.w_proj[i] @ h + e.b_proj[i])
        out.append(y)
    return torch.stack(out).view(x.shape)


def test_routed_experts_compute_each_tokens_weighted_top_k_outputs():
    moe = _moe()
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    assert torch.allclose(moe(x), _by_token(moe, x), rtol=0, atol=1e-12)


def test_an_expert_without_tokens_has_a_zero_gradient_and_every_parameter_has_one():
    moe = _moe()
    away = torch.zeros(4, dtype=torch.float64)
    away[3] = -1e9
    moe.router.register_forward_hook(lambda module, args, out: out + away)
    moe.train()
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    moe(x).square().sum().backward()
    assert int(moe.load[3]) == 0 and int(moe.load.sum()) == 2 * 6 * 2
    for name, p in moe.named_parameters():
        assert p.grad is not None, name
    for g in (moe.experts.w_fc.grad, moe.experts.w_proj.grad, moe.experts.b_fc.grad, moe.experts.b_proj.grad):
        assert torch.count_nonzero(g[3]) == 0 and torch.count_nonzero(g[:3]) > 0


def test_the_load_balancing_loss_is_switchs_and_trains_only():
    moe = _moe()
    moe.train()
    x = torch.randn(4, 7, 8, dtype=torch.float64)
    moe(x)
    probs = moe.router(x.reshape(-1, 8)).softmax(-1)
    ids = probs.topk(2, dim=-1).indices.reshape(-1)
    share = torch.bincount(ids, minlength=4).double() / ids.numel()
    assert torch.allclose(moe.aux_loss, 4 * (share * probs.mean(0)).sum())
    config = dataclasses.replace(PRESETS["tiny-moe"], vocab_size=50, block_size=16, aux_loss_coef=0.5)
    torch.manual_seed(0)
    model = GPT(config)
    idx = torch.randint(0, 50, (2, 16))
    model.eval()
    _, plain = model(idx, idx)
    model.train()
    _, trained = model(idx, idx)
    aux = sum(float(b.mlp.aux_loss.detach()) for b in model.h)
    assert float(trained.detach()) == pytest.approx(float(plain.detach()) + 0.5 * aux, rel=1e-6)


def test_tiny_moe_keeps_a_tokens_active_mlp_the_dense_width():
    dense, moe = build_model("tiny"), build_model("tiny-moe")
    assert moe.h[0].mlp.experts.w_fc.shape == (8, 256, 128)  # 4C / k = 256 wide, [E, out, in]
    active = 2 * 256  # two experts of 256 against one MLP of 4C = 512
    assert active == dense.h[0].mlp.c_fc.weight.shape[0]
    assert expert_parameter_names(moe)[:2] == ["h.0.mlp.experts.w_fc", "h.0.mlp.experts.w_proj"]
    counts = load_counts(moe)
    assert counts is not None and int(counts.sum()) == 0


def test_rows_by_source_rank_are_reordered_by_expert():
    by_source = torch.tensor([[2, 0, 1], [1, 3, 0]])  # [source rank, local expert]
    rows = [(i, e) for i in range(2) for e in range(3) for _ in range(int(by_source[i, e]))]
    order = _expert_major(by_source).tolist()
    assert [rows[k] for k in order] == sorted(rows, key=lambda r: (r[1], r[0]))


def test_busiest_share():
    assert busiest_share(torch.tensor([1, 1, 2])) == 0.5
    assert math.isnan(busiest_share(torch.zeros(3, dtype=torch.int64)))


@pytest.mark.parametrize(("values", "message"), [
    (dict(n_expert=4, top_k=5), "1 <= top_k <= n_expert"),
    (dict(n_expert=-1), "n_expert >= 0"),
    (dict(n_expert=4, expert_width=0), "expert_width must be positive"),
    (dict(n_expert=4, aux_loss_coef=-1.0), "aux_loss_coef must be >= 0"),
])
def test_a_bad_expert_shape_is_refused(values, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(n_layer=1, n_head=1, n_embd=8, vocab_size=8, block_size=8, **values)


@pytest.mark.parametrize(("options", "message"), [
    (dict(ep=2), "ep=2: splits a model's experts: the tiny preset has none"),
    (dict(preset="tiny-moe", ep=3), "ep=3: must divide the tiny-moe preset's 8 experts"),
    (dict(preset="tiny-moe", ep=0), "ep=0: must be a positive integer"),
    (dict(preset="tiny-moe", tp=2, dp=2), "tensor parallelism does not split experts yet"),
    (dict(preset="tiny-moe", pp=2), "pipelines do not carry the experts' load-balancing loss yet"),
    (dict(preset="tiny-moe", compile=True), "compile=True: is not supported with experts yet"),
    (dict(preset="tiny-moe", ep=2, nproc=3), r"ep\(2\) must divide the 3 replicas"),
    (dict(preset="tiny-moe", ep=2, method="torch-powersgd"), "not supported with --ep"),
    (dict(preset="tiny-moe", ep_wire="int8"), "ep_wire='int8': sets the experts' all-to-all: it needs ep > 1"),
    (dict(preset="tiny-moe", ep=2, ep_wire="fp8"), "ep_wire"),
])
def test_a_bad_expert_layout_is_refused_in_one_line(options, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**options).validate()


def test_edgc_train_refuses_ep_on_a_dense_preset_in_one_line(tmp_path, capsys):
    assert main(["train", "--preset", "tiny", "--ep", "2", "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "splits a model's experts" in err[0] and "tiny-moe" in err[0]


def _ckpt(model_config, world_size=4, ep=1):
    return {"train": {"preset": "tiny", "method": "edgc", "ep": ep}, "world_size": world_size,
            "model_config": model_config, "hsdp": [world_size, 1]}


def test_a_checkpoint_of_a_dense_model_saved_before_the_expert_fields_still_resumes():
    from edgc.train.checkpoint import check_compatible

    now = dataclasses.asdict(PRESETS["tiny"])
    before = {k: v for k, v in now.items() if k not in ("n_expert", "top_k", "expert_width", "aux_loss_coef")}
    check_compatible(_ckpt(before), world_size=4, preset="tiny", method="edgc", model_config=now, hsdp=(4, 1))
    with pytest.raises(ValueError, match="model: checkpoint"):
        check_compatible(_ckpt({**before, "n_expert": 8}), world_size=4, preset="tiny", method="edgc",
                         model_config=now, hsdp=(4, 1))


def test_a_run_with_split_experts_resumes_only_on_its_own_layout():
    from edgc.train.checkpoint import check_compatible

    config = dataclasses.asdict(PRESETS["tiny-moe"])
    with pytest.raises(ValueError, match="experts split over EP ranks resumes only on the layout it was saved on"):
        check_compatible({**_ckpt(config, ep=2), "train": {"preset": "tiny-moe", "method": "edgc", "ep": 2}},
                         world_size=2, preset="tiny-moe", method="edgc", model_config=config, hsdp=(2, 1))
