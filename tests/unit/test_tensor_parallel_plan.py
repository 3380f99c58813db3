"""The GPT-2 tensor-parallel plan's pure parts (edgc.train.tensor_parallel) and the layouts
`edgc train --tp` refuses before any worker starts."""

import pytest
import torch

from edgc.models import PRESETS, build_model
from edgc.train.config import TrainConfig
from edgc.train.tensor_parallel import check_tp, qkv_order, to_file_layout, to_tp_layout


def test_the_qkv_order_gives_each_rank_a_fused_qkv_of_its_own_heads():
    c, tp = 8, 2  # rows 0-7 are q, 8-15 k, 16-23 v; rank 0 holds heads 0-3 of each, rank 1 the rest
    order = qkv_order(c, tp)
    assert order.tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]
    assert qkv_order(c, 1).tolist() == list(range(24))


def test_checkpoint_layouts_round_trip_and_touch_only_c_attn():
    model = build_model("tiny", vocab_size=64, block_size=16)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    opt = {"state": {"h.0.attn.c_attn.weight": {"step": torch.tensor(3.0), "exp_avg": torch.randn(384, 128)},
                     "h.0.mlp.c_fc.weight": {"exp_avg": torch.randn(512, 128)}}, "param_groups": [{"lr": 1.0}]}
    tp_state, tp_opt = to_tp_layout(state, opt, 2, 128)
    order = qkv_order(128, 2)
    assert torch.equal(tp_state["h.1.attn.c_attn.weight"], state["h.1.attn.c_attn.weight"][order])
    assert torch.equal(tp_state["h.1.attn.c_attn.bias"], state["h.1.attn.c_attn.bias"][order])
    assert torch.equal(tp_opt["state"]["h.0.attn.c_attn.weight"]["exp_avg"],
                       opt["state"]["h.0.attn.c_attn.weight"]["exp_avg"][order])
    assert torch.equal(tp_state["wte.weight"], state["wte.weight"])  # (only c_attn's rows move)
    back, back_opt = to_file_layout(tp_state, tp_opt, 2, 128)
    for k in state:
        assert torch.equal(back[k], state[k]), k
    assert torch.equal(back_opt["state"]["h.0.attn.c_attn.weight"]["exp_avg"],
                       opt["state"]["h.0.attn.c_attn.weight"]["exp_avg"])
    assert back_opt["param_groups"] == opt["param_groups"]
    assert to_file_layout({}, {}, 2, 128) == ({}, {})  # (the ranks that hold no full state)


def test_check_tp_shows_the_arithmetic():
    check_tp(PRESETS["tiny"], 4)
    with pytest.raises(ValueError, match=r"n_head\(4\) % tp\(3\) = 1"):
        check_tp(PRESETS["tiny"], 3)


@pytest.mark.parametrize(("options", "message"), [
    (dict(tp=3, dp=2), r"tp=3: tensor parallelism splits whole attention heads: n_head\(4\) % tp\(3\) = 1"),
    (dict(tp=0), "tp=0: must be a positive integer"),
    (dict(tp=2, dp=2, nproc=3), r"dp\(2\) \* dp_shard\(1\) \* tp\(2\) != world\(3\)"),
    (dict(tp=2, pp=2, dp=2, nproc=6), r"pp\(2\) \* dp\(2\) \* tp\(2\) != world\(6\)"),
    (dict(tp=2, dp=2, compile=True), "compile=True: is not supported with tensor parallelism"),
    (dict(tp=2, dp=2, method="torch-powersgd"), "method='torch-powersgd': torch-powersgd is not supported with "
                                                 "tensor parallelism"),
    (dict(sequence_parallel=True), "sequence_parallel=True: splits the model over the TP ranks: it needs tp > 1"),
    (dict(tp=2, pp=2, dp=1, sequence_parallel=True), "sequence_parallel=True: is not supported with pipelines"),
])
def test_a_bad_tp_layout_is_refused_in_one_line(options, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**options).validate()


def test_the_workers_started_are_the_layouts_product():
    assert TrainConfig(tp=2, dp=2).workers() == 4
    assert TrainConfig(tp=2, dp_shard=2, dp_replicate=2).workers() == 8
    assert TrainConfig(tp=2, pp=2, dp=2).workers() == 8
    assert TrainConfig(tp=2, dp=2).hsdp_layout(4) == (2, 1, 2)
    assert TrainConfig(tp=2, pp=2, dp=2).pipeline_layout(8) == (2, 2, 2)
    assert TrainConfig(dp_shard=2).hsdp_layout(4) == (2, 2)  # (without TP, as before)


def test_a_resume_keeps_the_tp_layout():
    from edgc.train.trainer import RESUME_MAY_CHANGE

    assert not {"tp", "sequence_parallel", "vocab_parallel"} & set(RESUME_MAY_CHANGE)
