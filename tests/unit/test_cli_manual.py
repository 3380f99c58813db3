"""`edgc train --help` as a manual, and every other command's help to its standard; the
layout flags, the summary table in a terminal, the TensorBoard scalars of a metrics record,
and `log_stats` for a loop of one's own."""

import argparse
import dataclasses
import io
import logging
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from rich.console import Console
from torch.nn.parallel import DistributedDataParallel as DDP

from edgc import EDGCConfig, EDGCState, edgc_hook, log_stats
from edgc.cli import _as_typed, _shown, main
from edgc.comm.baselines import AllReduceState, allreduce_hook
from edgc.fields import field_types
from edgc.train.config import TrainConfig
from edgc.train.metrics import record_scalars
from edgc.train.summary import RunSummary, show_table, table


def _help() -> str:
    """`python -m edgc train --help` as a user runs it, its whitespace folded."""
    proc = subprocess.run([sys.executable, "-m", "edgc", "train", "--help"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "100"})
    assert proc.returncode == 0, proc.stderr
    return " ".join(proc.stdout.split())


def test_train_help_reads_as_a_manual():
    text = _help()
    # choices, defaults and docstrings
    assert "--method {none,powersgd,torch-powersgd,edgc,compute-only,diloco,edgc-diloco} Gradient sync:" in text
    assert "--diloco-inner-steps INT|null H, the local steps between DiLoCo's syncs." in text
    assert "\"compute-only\" syncs nothing" in text
    assert '"none" (plain all-reduce)' in text and "(default: edgc)" in text
    assert "--log {jsonl,tensorboard}" in text and "(default: jsonl)" in text
    assert "--steps INT Optimiser steps. A resume may change it:" in text
    assert "the rest of its schedule as the first length set it (docs/checkpoints.md). (default: 300)" in text
    # readable placeholders, and a bool flag's two forms
    assert "--out DIR" in text and "--data DIR|null" in text and "--edgc-schedule-ranks STEP:RANK,..." in text
    assert "--progress [true|false], --no-progress Show" in text
    assert "EDGC__" not in text and "DAC__" not in text and "TEXT" in text  # (TEXT: the description)
    # an EDGC default scaled to the run is given in words, the others as EDGCConfig's
    assert "(default: steps // 10, at least 1)" in text
    assert "--edgc-bins INT Histogram bins" in text
    assert "MAX_BINS (2**20). (default: 1000)" in text
    # the groups, in order, then the examples
    headings = ["which run:", "model and gradient sync:", "DiLoCo (--method diloco or edgc-diloco):",
                "workers and parallel layout:", "optimisation:", "data:",
                "evaluation:", "run folder, logging and checkpoints:", "EDGCConfig fields", "DACConfig fields",
                "examples:"]
    places = [text.index(h) for h in headings]
    assert places == sorted(places)
    assert "edgc train --pp 2 --dp 2 4 workers: 2 pipeline stages x 2 replicas" in text


def test_train_help_writes_null_true_false_as_the_command_line_does():
    # the fields' docstrings say None, True and False, as Python does; a flag takes null,
    # true and false, and the help says so (it said "None: the preset's")
    text = _help()
    for word in ("None", "True", "False"):
        assert not re.search(rf"\b{word}\b", text), re.search(rf".{{40}}\b{word}\b.{{40}}", text).group(0)
    assert "--block-size INT|null Context length; null: the preset's. (default: null)" in text
    assert "--min-lr FLOAT|null Floor of the cosine decay; null: lr / 10." in text
    assert "(null: all of it, about 9 MB" in text and "false keeps torch's placement" in text
    assert "--edgc-max-rank INT|null" in text and "null: calibrate it" in text
    # only whole words: a name that holds one (NoneType, Falsey) would be left as written
    assert _as_typed("None: x; NoneType, Falsey, not None.") == "null: x; NoneType, Falsey, not null."


def test_every_flag_has_its_default_and_every_field_one_group():
    from edgc.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    flags = [a for a in sub.choices["train"]._actions if a.option_strings and a.dest not in
             ("help", "config", "resume", "auto_resume", "overwrite")]
    assert flags and all(a.help.endswith(")") and "(default: " in a.help for a in flags)
    grouped = [name for names in TrainConfig.GROUPS.values() for name in names]
    assert len(grouped) == len(set(grouped))
    assert set(grouped) == {n for n, t in field_types(TrainConfig).items() if t.kind is not dict}


# every command but train (whose flags are generated from its config's fields, above), by its words
OTHER_COMMANDS = [("bench", "comm"), ("bench", "train"), ("bench", "pareto"), ("bench", "soak"), ("simulate",),
                  ("prepare",), ("report",)]


def _parser(words: tuple[str, ...]) -> argparse.ArgumentParser:
    from edgc.cli import build_parser

    parser = build_parser()
    for word in words:
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[word]
    return parser


@pytest.mark.parametrize("words", OTHER_COMMANDS, ids=" ".join)
def test_every_option_of_the_other_commands_is_explained_with_its_default(words, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # (one line per option: no word is broken at a hyphen)
    with pytest.raises(SystemExit) as exit_:
        main([*words, "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    parser = _parser(words)
    assert parser.description and parser.description.split()[0] in text
    if words[0] in ("bench", "simulate"):
        assert "examples: edgc " + " ".join(words) in text
    shown = [a for a in parser._actions if a.dest != "help" and a.help != argparse.SUPPRESS]
    assert len(shown) >= 2
    for action in shown:
        name = action.option_strings[0] if action.option_strings else action.dest
        assert action.help and action.help.strip(), f"{name} has no help"
        if action.nargs == 0 or action.default is None:  # (a flag without a value; a default in words)
            continue
        assert f"(default: {_shown(action.default)}" in text, f"{name}: its default {action.default!r} is not shown"
    for word in ("None", "True", "False"):
        assert not re.search(rf"\(default: {word}\b", text), word


def test_scaled_edgc_defaults_are_the_ones_the_run_sets():
    # every field the run sets differs from EDGCConfig's default here, so both sets are exact
    cfg = TrainConfig(method="powersgd", steps=300, rank=16, seed=5)
    ours, plain = dataclasses.asdict(cfg.edgc_config()), dataclasses.asdict(EDGCConfig())
    assert {k for k in ours if ours[k] != plain[k]} == set(TrainConfig.SCALED_EDGC_DEFAULTS)
    assert (ours["warmup_steps"], ours["window"], ours["iteration_sample_rate"]) == (30, 20, 0.25)


@pytest.mark.parametrize("given, workers", [
    ({}, 2), ({"nproc": 3}, 3), ({"pp": 2, "dp": 2}, 4), ({"dp": 3}, 3), ({"pp": 3}, 3), ({"pp": 2, "nproc": 4}, 4),
])
def test_the_layout_gives_the_workers(given, workers):
    cfg = TrainConfig(**given)
    assert cfg.workers() == workers
    assert cfg.resolve().nproc == workers


def test_nproc_against_the_layout_is_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--pp", "2", "--dp", "2", "--nproc", "3", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "pp(2) * dp(2) != world(3)" in err and "without --nproc, edgc train starts pp * dp = 4" in err
    assert not out.exists()


def test_tensorboard_missing_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # (as if it were not installed)
    out = tmp_path / "run"
    assert main(["train", "--log", "tensorboard", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'edgc[tensorboard]'" in err, err
    assert not out.exists()


def test_record_scalars_tag_each_field_by_kind():
    train = {"step": 3, "kind": "train", "loss": 5.5, "lr": 1e-3, "bytes_sent": 100, "bytes_uncompressed": 400,
             "rank": 4, "entropy": math.nan, "phase": "compress", "stage_rank": [4, 8]}
    assert record_scalars(train) == {
        "train/loss": 5.5, "train/lr": 1e-3, "train/bytes_sent": 100.0, "train/bytes_uncompressed": 400.0,
        "train/rank": 4.0, "train/compressing": 1.0, "train/stage_rank/0": 4.0, "train/stage_rank/1": 8.0,
        "train/compression_ratio": 4.0,  # (no entropy: not estimated yet)
    }
    assert record_scalars({**train, "phase": "warmup"})["train/compressing"] == 0.0
    val = {"step": 4, "kind": "val", "val_loss": 5.0, "val_loss_se": 0.1, "val_tokens": 256}
    assert record_scalars(val) == {"val/loss": 5.0, "val/loss_se": 0.1, "val/tokens": 256.0}


def _summaries() -> list[RunSummary]:
    return [RunSummary(name=name, method=name, steps=8, final_val_loss=loss, final_val_ppl=math.exp(loss),
                       total_bytes=sent, total_bytes_uncompressed=8_000_000, mean_step_time=0.2, total_comm_time=1.5,
                       mean_tokens_per_s=1000.0, final_rank=rank, final_val_loss_se=0.03)
            for name, loss, sent, rank in (("none", 5.9, 8_000_000, 0), ("edgc", 5.95, 2_000_000, 4))]


def _drawn(width: int) -> list[list[str]]:
    """The words of each line show_table draws on a terminal `width` columns wide."""
    terminal = Console(file=io.StringIO(), force_terminal=True, width=width, color_system=None)
    show_table(_summaries(), terminal)
    drawn = terminal.file.getvalue()
    assert "|" not in drawn and "---" not in drawn and "─" in drawn  # a drawn rule, not markdown pipes
    assert max(len(line) for line in drawn.splitlines()) <= width
    return [line.split() for line in drawn.splitlines()]


def test_summary_table_is_drawn_in_a_terminal_and_markdown_elsewhere():
    # wide enough: a row per run; narrower: a column per run, rather than wrapped cells
    assert ["edgc", "edgc", "8", "5.9500", "±", "0.0300", "+0.85%", "(beyond", "SE)", "383.75", "2.0", "0.250",
            "200.0", "1.50", "4"] in _drawn(200)
    narrow = _drawn(80)
    assert ["none", "edgc"] in narrow and ["val", "ppl", "365.04", "383.75"] in narrow
    assert ["final", "rank", "0", "4"] in narrow
    piped = Console(file=io.StringIO(), force_terminal=False)
    show_table(_summaries(), piped)
    assert piped.file.getvalue() == table(_summaries())  # what summary.md holds
    assert table(_summaries()).splitlines()[3].startswith("| edgc | edgc | 8 | 5.9500 ± 0.0300 | +0.85% (beyond SE) |")


def _train_steps(state, hook, steps: int, every: int, log) -> list[bool]:
    """Train a 2-layer model under DDP in this one process with `state`, calling log_stats
    after each step; returns what each call returned."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 16))
    ddp = DDP(model)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    logged = []
    for _ in range(steps):
        ddp(torch.randn(8, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        logged.append(log_stats(state, every=every, log=log))
    return logged


def test_log_stats_reports_every_n_steps(one_process_group):
    state = EDGCState(None, EDGCConfig(max_rank=2, warmup_steps=2, warmup="fixed", window=2,
                                       iteration_sample_rate=1.0))
    got = []
    logged = _train_steps(state, edgc_hook, 6, 2, lambda scalars, step: got.append((step, scalars)))
    assert logged == [False, True, False, True, False, True]
    assert [step for step, _ in got] == [2, 4, 6]
    first, last = got[0][1], got[-1][1]
    assert (first["edgc/compressing"], first["edgc/rank"]) == (0.0, 0.0)  # step 2: warm-up, sent whole
    assert (last["edgc/compressing"], last["edgc/rank"], last["edgc/compressed_steps"]) == (1.0, 2.0, 4.0)
    assert last["edgc/compression_ratio"] == last["edgc/bytes_uncompressed"] / last["edgc/bytes_sent"] > 1
    assert math.isfinite(last["edgc/entropy"]) and set(last) == {"edgc/" + k for k in state.stats().scalars()}


def test_log_stats_default_is_a_log_line_and_every_is_checked(one_process_group, caplog):
    with caplog.at_level(logging.INFO, logger="edgc.comm.stats"):
        _train_steps(AllReduceState(None), allreduce_hook, 3, 3, None)
    lines = [r.getMessage() for r in caplog.records if r.name == "edgc.comm.stats"]
    assert len(lines) == 1 and lines[0].startswith("EDGC step 3: sent whole (warm-up), entropy not estimated yet")
    assert "1.00x fewer bytes" in lines[0]
    for every in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="every="):
            log_stats(AllReduceState(None), every=every)


def test_a_pipeline_refuses_the_gradient_ended_warmup_in_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--pp", "2", "--dp", "1", "--edgc-warmup", "gradient", "--out", str(out),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert 'warmup="gradient": a pipeline\'s stages would end the warm-up at different steps' in err
    assert not out.exists()
