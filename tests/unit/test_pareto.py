"""The Pareto sweep's plan and its verdicts against the static frontier."""

import math

import pytest

from edgc.bench.pareto import (
    ParetoPoint,
    frontier_gap,
    frontier_verdict,
    pareto_markdown,
    parse_ranks,
    split_policies,
    static_ranks,
    sweep,
)


def _p(name, loss, mb, se=0.01, seconds=None, kind="static", rank=None):
    return ParetoPoint(name, kind, rank, loss, se, mb * 1e6, seconds if seconds is not None else mb, math.inf)


STATIC = [_p("r4", 3.80, 100, rank=4), _p("r8", 3.70, 200, rank=8), _p("r16", 3.62, 400, rank=16),
          _p("r32", 3.60, 800, rank=32)]


def test_static_ranks_are_powers_of_two_down_to_an_eighth():
    assert static_ranks(32) == [4, 8, 16, 32]
    assert static_ranks(4) == [1, 2, 4]
    assert static_ranks(1) == [1]


def test_sweep_runs_none_every_static_rank_torch_and_each_policy():
    names = [name for name, *_ in sweep(32, ["cqm", "linear"])]
    assert names == ["none", "powersgd-r4", "powersgd-r8", "powersgd-r16", "powersgd-r32", "torch-powersgd-r32",
                     "edgc-cqm", "edgc-linear"]
    import pytest

    with pytest.raises(ValueError, match="unknown dynamic policy"):
        sweep(32, ["static"])


def test_policy_specs_carry_a_rank_schedule():
    import pytest

    assert split_policies("cqm,critical,schedule=0:32,500:16") == ["cqm", "critical", "schedule=0:32,500:16"]
    assert split_policies("schedule=0:32,500:16;cqm") == ["schedule=0:32,500:16", "cqm"]
    name, kind, rank, args = sweep(32, ["schedule=0:32,500:16"])[-1]
    assert (name, kind, rank) == ("edgc-schedule", "dynamic", 32)
    assert args[-4:] == ["--edgc-policy", "schedule", "--edgc-schedule-ranks", "0:32,500:16"]
    with pytest.raises(ValueError, match="give a schedule"):
        sweep(32, ["schedule"])
    with pytest.raises(ValueError, match="give a schedule"):
        sweep(32, ["cqm=0:4"])


def test_verdicts_interpolate_in_log_bytes_with_the_standard_error_as_margin():
    # between r8 (200 MB, 3.70) and r16 (400 MB, 3.62): at 283 MB (the log midpoint) the frontier is 3.66
    mid = 200 * math.sqrt(2)
    assert frontier_verdict(_p("a", 3.60, mid, kind="dynamic"), STATIC, "bytes") == "beyond"
    assert frontier_verdict(_p("b", 3.665, mid, kind="dynamic"), STATIC, "bytes") == "on"
    assert frontier_verdict(_p("c", 3.70, mid, kind="dynamic"), STATIC, "bytes") == "behind"
    # a wider standard error turns "beyond" into "on"
    assert frontier_verdict(_p("d", 3.64, mid, se=0.03, kind="dynamic"), STATIC, "bytes") == "on"


def test_verdicts_outside_the_frontier_need_dominance():
    assert frontier_verdict(_p("cheap-good", 3.75, 50, kind="dynamic"), STATIC, "bytes") == "beyond"
    assert frontier_verdict(_p("cheap-bad", 3.90, 50, kind="dynamic"), STATIC, "bytes") == "outside the frontier"
    assert frontier_verdict(_p("dear-bad", 3.70, 1600, kind="dynamic"), STATIC, "bytes") == "behind"
    assert frontier_verdict(_p("dear-good", 3.50, 1600, kind="dynamic"), STATIC, "bytes") == "outside the frontier"
    assert frontier_verdict(_p("x", math.nan, 300, kind="dynamic"), STATIC, "bytes") == "no finite loss"
    assert frontier_verdict(_p("x", 3.6, 300, kind="dynamic"), [], "bytes") == "no frontier"


def test_a_run_at_the_frontiers_end_point_is_on_it():
    """A policy that held r_max sends r_max's bytes plus its control bytes: at that point,
    not outside the frontier (measured: 1677.52 MB against r32's 1677.52 MB, same loss)."""
    top = max(STATIC, key=lambda s: s.bytes)
    at_top = top.bytes / 1e6 * (1 + 2e-6)
    assert frontier_verdict(_p("held", top.val_loss, at_top, kind="dynamic"), STATIC, "bytes") == "on"
    assert frontier_verdict(_p("held-worse", top.val_loss + 0.1, at_top, kind="dynamic"), STATIC, "bytes") == "behind"
    far = top.bytes / 1e6 * 1.05
    assert frontier_verdict(_p("dearer", top.val_loss, far, kind="dynamic"), STATIC, "bytes") == "outside the frontier"
    assert frontier_verdict(_p("x", 3.6, 300, kind="dynamic"), [], "bytes") == "no frontier"


def test_the_report_names_the_frontier_wire_and_flags_a_run_in_another():
    statics = [ParetoPoint(f"powersgd-r{r}", "static", r, loss, 0.01, mb * 1e6, mb, math.inf, wire="int8")
               for r, loss, mb in ((8, 4.20, 100.0), (16, 4.15, 200.0), (32, 4.14, 400.0))]
    same = ParetoPoint("edgc-noise", "dynamic", 32, 4.10, 0.01, 150e6, 150.0, math.inf, wire="int8")
    other = ParetoPoint("edgc-native", "dynamic", 32, 4.10, 0.01, 150e6, 150.0, math.inf, wire="native")
    text = pareto_markdown([*statics, same, other], 4.14, "powersgd-r32", "setup.")
    assert "The static frontier's factors travel in int8" in text
    assert "| powersgd-r8 | int8 |" in text and "| edgc-native | native |" in text
    assert "edgc-noise: reaches" in text and "(int8 wire, as this run's): beyond" in text
    assert "(int8 wire; this run's is native: not the same wire)" in text


def test_a_policy_spec_carries_settings_for_its_run():
    assert split_policies("noise;noise[noise_exponent=0.5,long_rank_factor=1]") == [
        "noise", "noise[noise_exponent=0.5,long_rank_factor=1]"]
    assert split_policies("noise,noise[noise_exponent=0.5,min_rank=4],cqm") == [
        "noise", "noise[noise_exponent=0.5,min_rank=4]", "cqm"]
    name, kind, rank, args = sweep(32, ["noise[noise_exponent=0.5,long_rank_factor=1]"])[-1]
    assert (name, kind, rank) == ("edgc-noise-noise_exponent-0.5-long_rank_factor-1", "dynamic", 32)
    assert args[-6:] == ["--edgc-policy", "noise", "--edgc-noise-exponent", "0.5", "--edgc-long-rank-factor", "1"]
    for bad in ("noise[noise_exponent=0.5", "noise[noise_exponent]", "noise[=1]"):
        with pytest.raises(ValueError, match="settings go in brackets|FIELD=VALUE"):
            sweep(32, [bad])
    with pytest.raises(ValueError, match="names a run twice"):
        sweep(32, ["noise", "noise"])


def test_static_ranks_can_be_given():
    assert parse_ranks("8,16,24,32", 32) == [8, 16, 24, 32]
    assert parse_ranks("32,24", 32) == [24, 32]
    names = [name for name, *_ in sweep(32, ["noise"], [8, 16, 24, 32])]
    assert names == ["none", "powersgd-r8", "powersgd-r16", "powersgd-r24", "powersgd-r32", "torch-powersgd-r32",
                     "edgc-noise"]
    for bad in ("8,16", "0,32", "8,x,32", "16,40"):
        with pytest.raises(ValueError, match="--static-ranks"):
            parse_ranks(bad, 32)


def test_the_gap_below_the_frontier_is_the_verdicts():
    inside = _p("x", 3.61, 300, kind="dynamic")  # between r8 (200, 3.70) and r16 (400, 3.62)
    gap, margin = frontier_gap(inside, STATIC)
    w = math.log(300 / 200) / math.log(400 / 200)
    assert gap == pytest.approx(3.70 + w * (3.62 - 3.70) - 3.61)
    assert margin == pytest.approx(math.hypot(0.01, 0.01))
    assert (gap > margin) == (frontier_verdict(inside, STATIC, "bytes") == "beyond")
    assert frontier_gap(_p("y", 3.5, 50, kind="dynamic"), STATIC) is None  # (outside the frontier's bytes)


def _run_folder(path, kind, losses, mb_per_step, wire="int8"):
    """A run folder as edgc train writes it: config.json and metrics.jsonl with a train record
    a step (bytes_sent, step_time) and a val record at each step of `losses`."""
    import json

    path.mkdir()
    (path / "config.json").write_text(json.dumps({"method": kind, "edgc": {"wire": wire}}))
    records = []
    for step in range(1, max(losses) + 1):
        records.append({"step": step, "kind": "train", "bytes_sent": mb_per_step(step) * 1e6, "step_time": 0.1})
        if step in losses:
            records.append({"step": step, "kind": "val", "val_loss": losses[step], "val_loss_se": 0.01})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_along_the_run_each_evaluation_is_judged_against_the_statics_at_that_step(tmp_path):
    from edgc.bench.pareto import along_markdown, points_along

    _run_folder(tmp_path / "r8", "powersgd", {10: 4.0, 20: 3.5}, lambda s: 1.0)
    _run_folder(tmp_path / "r16", "powersgd", {10: 3.9, 20: 3.4}, lambda s: 2.0)
    # dear at first (3 MB a step: outside the frontier at step 10), then cheap (0.5 MB a step)
    _run_folder(tmp_path / "dyn", "edgc", {10: 3.85, 20: 3.40}, lambda s: 3.0 if s <= 10 else 0.5)
    along = {"r8": points_along("r8", "static", 8, tmp_path / "r8"),
             "r16": points_along("r16", "static", 16, tmp_path / "r16"),
             "dyn": points_along("dyn", "dynamic", 16, tmp_path / "dyn")}
    dyn = along["dyn"]
    assert sorted(dyn) == [10, 20]
    assert dyn[10].bytes == pytest.approx(30e6) and dyn[20].bytes == pytest.approx(35e6)  # summed to the step
    assert (dyn[10].val_loss, dyn[10].wire, along["r16"][20].bytes) == (3.85, "int8", pytest.approx(40e6))
    text = along_markdown(along, "r16")
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| 1")
            or line.startswith("| 2")}
    assert "3.8500, 1.500x, outside the frontier" in rows["10"]
    # step 20: 35 MB between r8's 20 MB (3.5) and r16's 40 MB (3.4), in log bytes: 3.5 - 0.1 * log(1.75) / log(2)
    below = 3.5 - 0.1 * math.log(1.75) / math.log(2) - 3.40
    assert f"3.4000, 0.875x, {below:+.4f} ({math.hypot(0.01, 0.01):.4f})" in rows["20"]
    # nothing to draw without a dynamic run, or with one static run
    assert along_markdown({k: along[k] for k in ("r8", "r16")}, "r16") == ""
    assert along_markdown({k: along[k] for k in ("r16", "dyn")}, "r16") == ""
    # the report carries the table before its plots
    report = pareto_markdown([_p("r16", 3.4, 40), _p("dyn", 3.4, 35, kind="dynamic")], 3.4, "r16", "setup.", text)
    assert report.index("## Along the run") < report.index("![loss vs bytes]")


def test_a_static_rank_another_beats_is_not_part_of_the_frontier():
    # r8 sent more than r16 (a longer warm-up) and ended higher: the frontier runs r4 -> r16 -> r32
    statics = [_p("r4", 3.80, 100, rank=4), _p("r8", 3.70, 450, rank=8), _p("r16", 3.62, 400, rank=16),
               _p("r32", 3.60, 800, rank=32)]
    at_420 = _p("x", 3.60, 420, kind="dynamic")
    gap, _ = frontier_gap(at_420, statics)
    line = 3.62 + (3.60 - 3.62) * math.log(420 / 400) / math.log(2)  # between r16 and r32, not r8 and r16
    assert gap == pytest.approx(line - 3.60)
    # at 430 MB the line r16 -> r8 would put the frontier at 3.66 and this point beyond it
    assert frontier_verdict(_p("y", 3.63, 430, kind="dynamic"), statics, "bytes") == "on"
    y = _p("y", 3.63, 430, kind="dynamic")
    assert frontier_gap(y, statics) == frontier_gap(y, [statics[0], statics[2], statics[3]])
