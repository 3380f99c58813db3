"""The Pareto sweep's plan and its verdicts against the static frontier."""

import dataclasses
import math

import numpy as np
import pytest

from edgc.bench.pareto import (
    ParetoPoint,
    frontier_gap,
    frontier_verdict,
    judge,
    paired_gap,
    pareto_markdown,
    parse_ranks,
    run_dir,
    split_policies,
    static_ranks,
    sweep,
)
from edgc.train.blocks import BlockLosses


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


def test_diloco_adds_a_diloco_and_an_edgc_diloco_run_at_each_h_judged_against_its_twin():
    runs = sweep(32, ["noise"], [32], diloco=[5, 20])
    assert [(n, k, r) for n, k, r, _ in runs[-4:]] == [
        ("diloco-h5", "diloco", None), ("edgc-diloco-h5", "edgc-diloco", 32),
        ("diloco-h20", "diloco", None), ("edgc-diloco-h20", "edgc-diloco", 32)]
    assert runs[-1][3] == ["--method", "edgc-diloco", "--rank", "32", "--diloco-inner-steps", "20"]
    points = [_p("powersgd-r32", 3.60, 800, rank=32), _p("diloco-h5", 3.70, 80, kind="diloco"),
              _p("edgc-diloco-h5", 3.72, 8, kind="edgc-diloco", rank=32)]
    text = pareto_markdown(points, 3.60, "powersgd-r32", "setup.")
    assert "- edgc-diloco-h5 against diloco-h5: 0.100x its bytes; final loss +0.0200 ± " in text


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
    assert f"3.4000, 0.875x, {below:+.4f} ({math.hypot(0.01, 0.01):.4f} combined)" in rows["20"]
    # nothing to draw without a dynamic run, or with one static run
    assert along_markdown({k: along[k] for k in ("r8", "r16")}, "r16") == ""
    assert along_markdown({k: along[k] for k in ("r16", "dyn")}, "r16") == ""
    # the report carries the table before its plots
    report = pareto_markdown([_p("r16", 3.4, 40), _p("dyn", 3.4, 35, kind="dynamic")], 3.4, "r16", "setup.", text)
    assert report.index("## Along the run") < report.index("![loss vs bytes]")


def test_along_the_run_the_margin_is_paired_where_the_runs_kept_each_evaluation_s_blocks(tmp_path):
    from edgc.bench.pareto import along_markdown, points_along
    from edgc.train.blocks import save_block_losses

    losses = {"r8": {10: 4.0, 20: 3.5}, "r16": {10: 3.9, 20: 3.4}, "dyn": {10: 3.95, 20: 3.40}}
    for name, mb in (("r8", 1.0), ("r16", 2.0), ("dyn", 1.75)):
        _run_folder(tmp_path / name, "edgc" if name == "dyn" else "powersgd", losses[name], lambda s, mb=mb: mb)
        for step, loss in losses[name].items():  # (each block: the loss, plus the blocks' shared hardness)
            if name != "dyn" or step == 20:  # (dyn kept step 20's blocks only)
                save_block_losses(tmp_path / name, step, BLOCK_STARTS, loss + HARDNESS - HARDNESS.mean())
    along = {name: points_along(name, "static" if name != "dyn" else "dynamic", 8, tmp_path / name)
             for name in ("r8", "r16", "dyn")}
    assert along["dyn"][10].blocks is None and along["dyn"][20].blocks.step == 20
    rows = {line.split(" | ")[0].strip("| "): line for line in along_markdown(along, "r16").splitlines()
            if line.startswith(("| 1", "| 2"))}
    # at step 20 the gap moves with no block's noise: paired SE 0; at step 10 dyn kept no blocks
    below = 3.5 - 0.1 * math.log(1.75) / math.log(2) - 3.40
    assert f"{below:+.4f} (0.0000)" in rows["20"]
    gap10 = 4.0 - 0.1 * math.log(1.75) / math.log(2) - 3.95
    assert f"{gap10:+.4f} ({math.hypot(0.01, 0.01):.4f} combined)" in rows["10"]


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


# ---------------------------------------------------------------- paired verdicts, seeds

BLOCK_STARTS = np.arange(400, dtype=np.int64) * 128
# the blocks' own spread: some text is harder than other, for every run alike
HARDNESS = np.random.default_rng(0).normal(0.0, 0.5, size=400)


def _run(name, loss, mb, kind="dynamic", rank=None, seed=1337, noise=0.002):
    """A run whose block losses are `loss` plus the blocks' shared hardness plus its own
    small noise: combined SE ≈ 0.025, paired SE ≈ 0.0001 to 0.0002."""
    rng = np.random.default_rng(abs(hash((name, seed))) % 2**32)
    losses = loss + HARDNESS - HARDNESS.mean() + rng.normal(0.0, noise, size=400)
    losses += loss - losses.mean()  # (the mean exactly `loss`)
    se = float(losses.std(ddof=1) / math.sqrt(400))
    return ParetoPoint(name, kind, rank, loss, se, mb * 1e6, mb, math.inf, "int8", seed,
                       BlockLosses(step=100, starts=BLOCK_STARTS, losses=losses))


def _statics(seed=1337, shift=0.0):
    return [_run("powersgd-r8", 3.70 + shift, 200, "static", 8, seed), _run("powersgd-r16", 3.62 + shift, 400,
            "static", 16, seed), _run("powersgd-r32", 3.60 + shift, 800, "static", 32, seed)]


def test_a_paired_gap_sees_what_the_combined_se_hides():
    """0.01 below the frontier: within the combined SE (≈ 0.035), but hundreds of paired SEs."""
    mid = 200 * math.sqrt(2)  # (the frontier is 3.66 there)
    point = _run("edgc-noise", 3.65, mid)
    statics = _statics()
    gap, combined = frontier_gap(point, statics)
    assert math.isclose(gap, 0.01, abs_tol=1e-9) and combined > 0.03
    pgap, pse = paired_gap(point, statics)
    assert math.isclose(pgap, gap, abs_tol=1e-9)  # (the same gap, block by block)
    assert pse < 0.001
    j = judge([point], [statics])
    assert (j.verdict, j.paired, j.seed_se, j.seeds) == ("beyond", True, None, 1)
    assert j.describe().startswith("beyond (+0.0100 below, margin 0.0") and "paired SE" in j.describe()
    assert "one seed" in j.describe()
    # without block losses the same run is judged with the combined SE, as before
    bare = dataclasses.replace(point, blocks=None)
    assert judge([bare], [statics]).verdict == "on" and not judge([bare], [statics]).paired


def test_the_seeds_spread_widens_the_margin():
    mid = 200 * math.sqrt(2)
    seeds = [1337, 1338, 1339]
    # every seed's static runs alike; the policy 0.01 below the frontier on average, but
    # 0.03 above or below it from seed to seed: the seeds' spread makes it "on"
    statics = [_statics(s) for s in seeds]
    wobbly = [_run("edgc-noise", 3.65 + d, mid, seed=s) for s, d in zip(seeds, (-0.03, 0.0, 0.03), strict=True)]
    j = judge(wobbly, statics)
    assert j.verdict == "on" and j.seeds == 3
    assert j.seed_se is not None and math.isclose(j.seed_se, 0.03 / math.sqrt(3), rel_tol=1e-6)
    assert j.margin == j.seed_se > j.eval_se
    steady = [_run("edgc-noise", 3.65 + d, mid, seed=s) for s, d in zip(seeds, (-0.001, 0.0, 0.001), strict=True)]
    assert judge(steady, statics).verdict == "beyond"
    # each seed is judged against its own seed's frontier: a seed whose every run is 0.05
    # higher moves nothing
    shifted = [_statics(s, shift=0.05 if s == 1339 else 0.0) for s in seeds]
    moved = [dataclasses.replace(p, val_loss=p.val_loss + (0.05 if p.seed == 1339 else 0.0),
                                 blocks=BlockLosses(100, BLOCK_STARTS, p.blocks.losses + (0.05 if p.seed == 1339
                                                                                           else 0.0)))
             for p in steady]
    assert judge(moved, shifted).verdict == "beyond"
    assert math.isclose(judge(moved, shifted).below, judge(steady, statics).below, abs_tol=1e-9)


def test_paired_verdicts_at_and_past_the_frontiers_ends():
    statics = _statics()
    at_top = _run("held", 3.60, 800 * (1 + 2e-6))
    assert judge([at_top], [statics]).verdict == "on"
    assert judge([_run("held-worse", 3.61, 800 * (1 + 2e-6))], [statics]).verdict == "behind"
    assert judge([_run("cheap-good", 3.69, 100)], [statics]).verdict == "beyond"  # (0.01 below r8, fewer bytes)
    assert judge([_run("dear-good", 3.59, 1600)], [statics]).verdict == "outside the frontier"
    # inside the span on one seed and past its end on another: no verdict
    seeds = [_statics(1337), _statics(1338)]
    assert judge([_run("x", 3.6, 700, seed=1337), _run("x", 3.6, 900, seed=1338)], seeds).verdict \
        == "outside the frontier"


def test_the_report_pairs_every_run_with_every_static_rank_over_the_seeds():
    mid = 200 * math.sqrt(2)
    points = []
    for s in (1337, 1338):
        points += [*_statics(s), _run("edgc-noise", 3.65 + (0.001 if s == 1338 else 0.0), mid, seed=s)]
    text = pareto_markdown(points, 3.60, "powersgd-r32", "setup.")
    assert "final val loss, mean of 2 seeds ± their SD" in text
    assert "| edgc-noise | int8 | 3.6505 ± 0.0007 |" in text
    assert "## Paired differences" in text and "| run | vs powersgd-r8 | vs powersgd-r16 | vs powersgd-r32 |" in text
    row = next(line for line in text.splitlines() if line.startswith("| edgc-noise | -0.0495"))
    assert "(seeds ± 0.0005)" in row and "| +0.0505 ± " in row
    assert "| powersgd-r32 | -0.1000 ± " in text and "| —" in text  # (a static rank against the others, not itself)
    assert "edgc-noise: does not reach powersgd-r32's final loss within the margin (+0.0505" in text
    assert "beyond (+0.0095 below, margin 0.0005: paired SE 0.0001, seed SE 0.0005 over 2 seeds)" in text
    assert "the larger of the gap's paired SE and its seed SE" in text
    with pytest.raises(ValueError, match="has seeds"):
        pareto_markdown(points[:-1], 3.60, "powersgd-r32", "setup.")


def test_the_paired_differences_set_every_run_against_none_first_where_it_ran():
    points = [_run("none", 3.55, 1600, "none"), *_statics(), _run("diloco-h5", 3.70, 320, "diloco"),
              _run("edgc-diloco-h5", 3.71, 32, "edgc-diloco", 32)]
    text = pareto_markdown(points, 3.60, "powersgd-r32", "setup.").split("## Paired differences")[1]
    assert "minus none's (uncompressed) and each static rank's" in text
    assert "| run | vs none | vs powersgd-r8 | vs powersgd-r16 | vs powersgd-r32 |" in text
    assert "| diloco-h5 | +0.1500 ± 0.000" in text and "| edgc-diloco-h5 | +0.1600 ± 0.000" in text
    assert "| none | — | -0.1500 ± " in text


def test_runs_of_the_first_seed_stay_where_a_sweep_of_one_seed_puts_them(tmp_path):
    assert run_dir(tmp_path, "edgc-noise", 1337, 1337) == tmp_path / "edgc-noise"
    assert run_dir(tmp_path, "edgc-noise", 1339, 1337) == tmp_path / "seed1339" / "edgc-noise"
