"""`edgc simulate --moe`: a mixture of experts' traffic per GPU, by kind."""

import pytest

from edgc.bench.simulate.cluster import load_cluster
from edgc.bench.simulate.moe import MOE_MODELS, moe_traffic
from edgc.cli import main


def test_the_public_configurations_have_their_published_sizes():
    assert MOE_MODELS["mixtral-8x7b"].params / 1e9 == pytest.approx(46.7, abs=0.1)
    assert MOE_MODELS["deepseek-moe-16b"].params / 1e9 == pytest.approx(16.4, abs=0.1)


def test_each_kind_of_traffic_follows_its_group():
    cluster = load_cluster("paper-12.1b")  # 64 GPUs, 8 a node, 400 Gbit/s a node shared by 8
    model = MOE_MODELS["mixtral-8x7b"]
    t = moe_traffic(model, cluster, ep=8, tokens=1000, rank=32)
    rows = {r[0]: r for r in t.rows}
    expert_values = 3 * 14336 * 4096 * 1 * 32  # one expert a GPU in each of 32 layers
    assert rows["expert gradient"][2] == pytest.approx(2 * 7 / 8 * expert_values * 2)  # ring of 8, bf16
    assert rows["token all-to-all"][2] == pytest.approx(4 * 1000 * 2 * 4096 * 2 * 7 / 8 * 32)
    assert rows["token all-to-all"][2] == rows["token all-to-all"][3]  # (activations: not compressed)
    assert rows["dense gradient"][3] < rows["dense gradient"][2] / 10
    one = moe_traffic(model, cluster, ep=1, tokens=1000)
    assert {r[0]: r for r in one.rows}["token all-to-all"][2] == 0
    with pytest.raises(ValueError, match="must divide"):
        moe_traffic(model, cluster, ep=16, tokens=1000)


def test_edgc_simulate_moe_prints_the_table_and_the_bottleneck(capsys):
    assert main(["simulate", "--cluster", "paper-12.1b", "--moe", "deepseek-moe-16b", "--ep", "8"]) == 0
    out = capsys.readouterr().out
    assert "| expert gradient | inter-node, ring of 8 |" in out
    assert "with edgc at rank 32: the token all-to-all" in out


@pytest.mark.parametrize("extra", [[], ["--memory"]])
def test_a_preset_with_experts_is_refused_by_the_dense_projection_naming_moe(extra, capsys):
    assert main(["simulate", "--preset", "tiny-moe", *extra]) == 2
    err = capsys.readouterr().err
    assert "--moe NAME" in err and len(err.strip().splitlines()) == 1
