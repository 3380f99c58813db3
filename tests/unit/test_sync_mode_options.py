"""Where the sync mode and the compute-only baseline reach the commands: the pipelined
mode is the default of plain DDP, pipeline stages keep whole steps, a run made before the
modes existed resumes in the one it ran in, a resumed run may change its units' size, and
the benchmarks can name both modes."""

import pytest

from edgc.bench.comm import _methods, _sync_modes
from edgc.bench.train import _method_args
from edgc.train.checkpoint import save_checkpoint
from edgc.train.config import TrainConfig
from edgc.train.trainer import resume_config


def test_plain_ddp_pipelines_and_pipeline_stages_sync_whole_steps():
    assert TrainConfig().edgc_config().sync_mode == "pipelined"
    assert TrainConfig(pp=2, nproc=2).edgc_config().sync_mode == "whole-step"
    assert TrainConfig(pp=2, nproc=2, edgc={"sync_mode": "pipelined"}).edgc_config().sync_mode == "pipelined"


def test_compute_only_is_refused_in_a_pipeline(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    TrainConfig(method="compute-only").validate()
    with pytest.raises(ValueError, match="method='compute-only'.*pp > 1"):
        TrainConfig(method="compute-only", pp=2, nproc=2).validate()


def test_a_run_from_before_the_sync_modes_resumes_whole_step(tmp_path, as_edgc_0_1):
    old = TrainConfig(out=str(tmp_path)).resolve().to_dict()
    old["edgc"] = as_edgc_0_1(old["edgc"])
    del old["edgc"]["sync_mode"]  # (as config.json and checkpoints were written before)
    save_checkpoint(tmp_path / "checkpoint.pt", {"step": 3, "train": old})
    assert resume_config(tmp_path / "checkpoint.pt", {}).edgc_config().sync_mode == "whole-step"
    new = TrainConfig(out=str(tmp_path)).resolve().to_dict()
    save_checkpoint(tmp_path / "checkpoint.pt", {"step": 3, "train": new})
    assert resume_config(tmp_path / "checkpoint.pt", {}).edgc_config().sync_mode == "pipelined"


def test_a_resumed_run_may_change_min_unit_mb_and_no_other_edgc_option(tmp_path, as_edgc_0_1):
    saved = TrainConfig(out=str(tmp_path), edgc={"min_unit_mb": 0.5}).resolve().to_dict()
    save_checkpoint(tmp_path / "checkpoint.pt", {"step": 3, "train": saved})
    resumed = resume_config(tmp_path / "checkpoint.pt", {"edgc": {"min_unit_mb": 2.0}, "steps": 400})
    assert resumed.edgc_config().min_unit_mb == 2.0 and resumed.steps == 400
    assert resume_config(tmp_path / "checkpoint.pt", {}).edgc_config().min_unit_mb == 0.5
    with pytest.raises(ValueError, match=r"--edgc-window 7 \(the run's: 20\).*only these may change.*"
                                         r"edgc\.min_unit_mb"):
        resume_config(tmp_path / "checkpoint.pt", {"edgc": {"min_unit_mb": 2.0, "window": 7}})
    old = TrainConfig(out=str(tmp_path)).resolve().to_dict()
    old["edgc"] = as_edgc_0_1(old["edgc"])
    del old["edgc"]["min_unit_mb"]  # (as runs were saved before the option existed)
    save_checkpoint(tmp_path / "checkpoint.pt", {"step": 3, "train": old})
    assert resume_config(tmp_path / "checkpoint.pt", {}).edgc_config().min_unit_mb == 0.0


def test_bench_train_names_the_whole_step_mode_and_the_compute_only_baseline():
    assert _method_args("compute-only", 32) == ("compute-only", ["--method", "compute-only"])
    assert _method_args("diloco-h20", 32) == ("diloco-h20", ["--method", "diloco", "--rank", "32",
                                                              "--diloco-inner-steps", "20"])
    assert _method_args("edgc-diloco-h5", 32)[1][:2] == ["--method", "edgc-diloco"]
    assert _method_args("edgc-wholestep", 32) == ("edgc-wholestep", ["--method", "edgc", "--rank", "32",
                                                                      "--edgc-sync-mode", "whole-step"])
    assert _method_args("powersgd-rmin-wholestep", 32)[1] == ["--method", "powersgd", "--rank", "8",
                                                              "--edgc-sync-mode", "whole-step"]
    for bad in ("none-wholestep", "torch-powersgd-wholestep", "edgc-fast"):
        with pytest.raises(ValueError, match="unknown method"):
            _method_args(bad, 32)


def test_bench_comm_times_each_asked_mode():
    names = [name for name, _ in _methods(8, 2, _sync_modes("pipelined,whole-step"))]
    assert names == ["none", "torch-powersgd", "powersgd", "edgc r=2", "edgc r=4", "edgc r=8",
                     "powersgd (whole-step)", "edgc r=2 (whole-step)", "edgc r=4 (whole-step)",
                     "edgc r=8 (whole-step)"]
    with pytest.raises(ValueError, match="--sync-modes"):
        _sync_modes("pipelined,eager")
