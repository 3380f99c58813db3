"""The experts' own compression settings (TrainConfig.expert_edgc, `--expert-edgc-FIELD`, a
config file's [expert_edgc] table): what they inherit from the run, what they refuse, and
that a resumed run keeps them."""

import pytest

from edgc.cli import _given_options, build_parser
from edgc.train.checkpoint import save_checkpoint
from edgc.train.config import TrainConfig
from edgc.train.trainer import resume_config

MOE = dict(preset="tiny-moe", ep=2, nproc=4, steps=1000)


def test_each_field_not_given_is_the_runs():
    cfg = TrainConfig(**MOE, edgc={"window": 50}, expert_edgc={"min_rank": 16, "noise": {"exponent": 0.5}})
    run, experts = cfg.edgc_config(), cfg.expert_edgc_config()
    assert (experts.min_rank, experts.noise.exponent) == (16, 0.5)
    assert (run.min_rank, run.noise.exponent) != (16, 0.5)
    assert (experts.max_rank, experts.window, experts.seed, experts.warmup_min_steps) == \
        (run.max_rank, 50, run.seed, run.warmup_min_steps) == (32, 50, 1337, 50)


def test_a_warmup_of_their_own_drops_the_runs_settings_of_another_mode():
    # the run's warm-up ends on the gradient after the learning rate's (warmup_min_steps
    # 50); experts sent whole for good do not read it, and would be refused with it
    cfg = TrainConfig(**MOE, expert_edgc={"warmup": "fixed", "warmup_steps": 10**9, "wire": "native"})
    experts = cfg.expert_edgc_config()
    assert (experts.warmup, experts.warmup_steps, experts.warmup_min_steps, experts.wire) == \
        ("fixed", 10**9, 0, "native")
    assert cfg.edgc_config().warmup_min_steps == 50
    given = TrainConfig(**MOE, expert_edgc={"warmup": "fixed", "warmup_min_steps": 5})
    with pytest.raises(ValueError, match=r'^expert_edgc: EDGCConfig.warmup_min_steps=5: is read by warmup="gradient"'):
        given.validate()


@pytest.mark.parametrize(("values", "message"), [
    (dict(preset="tiny", expert_edgc={"min_rank": 8}), r"^expert_edgc \(min_rank=8\) sets .*the tiny preset has none"),
    (dict(**MOE, method="none", expert_edgc={"min_rank": 8}),
     r"^expert_edgc \(min_rank=8\) sets .*method 'none' compresses nothing"),
    (dict(preset="tiny-moe", expert_edgc={"min_rank": 8}), r"^expert_edgc \(min_rank=8\) sets the experts' own "
                                                            r"core, which an FSDP2 run has .*under DDP"),
    (dict(**MOE, expert_edgc={"min_rank": 64}), r"^expert_edgc: EDGCConfig.min_rank=64"),
    (dict(**MOE, expert_edgc={"ranks": 4}), r"^expert_edgc: EDGCConfig has no field\(s\).*ranks"),
])
def test_bad_expert_settings_are_refused_by_name(values, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**values).validate()


def test_resolve_writes_them_out_whole_and_a_run_without_them_keeps_none():
    resolved = TrainConfig(**MOE, expert_edgc={"max_rank": 16}).resolve()
    assert resolved.expert_edgc["max_rank"] == 16 and resolved.expert_edgc["window"] == resolved.edgc["window"]
    assert resolved.resolve().expert_edgc == resolved.expert_edgc
    assert TrainConfig(**MOE).resolve().expert_edgc == {}


def test_flags_and_the_config_file_table_set_them(tmp_path):
    parser = build_parser()
    given = _given_options(parser.parse_args(["train", "--expert-edgc-min-rank", "8", "--expert-edgc-noise-exponent",
                                              "0.5", "--no-expert-edgc-warm-start", "--edgc-min-rank", "4"]))
    assert given["expert_edgc"] == {"min_rank": 8, "noise_exponent": 0.5, "warm_start": False}
    assert given["edgc"] == {"min_rank": 4}
    path = tmp_path / "run.toml"
    path.write_text('preset = "tiny-moe"\n[expert_edgc]\nmin_rank = 8\npolicy = "static"\n')
    given = _given_options(parser.parse_args(["train", "--config", str(path), "--expert-edgc-min-rank", "12"]))
    assert given["expert_edgc"] == {"min_rank": 12, "policy": "static"}  # (the flag wins)


def test_a_resumed_run_keeps_the_experts_settings(tmp_path):
    saved = TrainConfig(**MOE, out=str(tmp_path), expert_edgc={"noise": {"exponent": 0.5}}).resolve().to_dict()
    save_checkpoint(tmp_path / "checkpoint.pt", {"step": 3, "train": saved})
    assert resume_config(tmp_path / "checkpoint.pt", {}).expert_edgc_config().noise.exponent == 0.5
    same = resume_config(tmp_path / "checkpoint.pt", {"expert_edgc": {"noise_exponent": 0.5}})
    assert same.expert_edgc_config().noise.exponent == 0.5
    with pytest.raises(ValueError, match=r"--expert-edgc-noise-exponent 0.25 \(the run's: 0.5\)"):
        resume_config(tmp_path / "checkpoint.pt", {"expert_edgc": {"noise_exponent": 0.25}})
    plain = TrainConfig(**MOE, out=str(tmp_path)).resolve().to_dict()
    save_checkpoint(tmp_path / "checkpoint.pt", {"step": 3, "train": plain})
    with pytest.raises(ValueError, match="--expert-edgc-min-rank 8"):
        resume_config(tmp_path / "checkpoint.pt", {"expert_edgc": {"min_rank": 8}})
