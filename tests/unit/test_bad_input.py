"""Bad input to `edgc train`: one line on stderr naming the flag or field, exit status 2,
no traceback, and nothing written. The bad values are generated for every flag of the
train parser from its field's type, so a new flag is covered without touching this file."""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from edgc import EDGCConfig, EDGCState
from edgc.cli import _given_options, build_parser, main
from edgc.config import SECTIONS
from edgc.fields import field_types
from edgc.policy.dac import DACConfig
from edgc.train.checkpoint import CHECKPOINT_NAME, save_checkpoint
from edgc.train.config import TrainConfig, load_config_file

# Each field kind's bad values; "{file}" is an existing file, "{file}/sub" a path under it.
BAD_INT = ["nan", "inf", "-inf", "-1", "0", "abc", "true", "[]", "3.5", "1e3", "1e400", str(10**12), str(2**63),
           "1" + "0" * 5000, ""]
BAD_FLOAT = ["nan", "NaN", "inf", "-inf", "-1", "0", "abc", "true", "[]", "1e-3x", "1e400", "1e12", ""]
BAD_CHOICE = ["abc", "", "nan", "null", "[]"]
BAD_TEXT = ["", "{file}", "{file}/sub"]
BAD_BOOL = ["maybe", "2", "nan", "null", ""]

# (flag, value) pairs from the bad sets above that are valid for that flag. Each is still
# checked: no traceback, at most one line, and exit 0 or 2 (here 2, "already holds a run",
# since --out names an existing run).
ALLOWED = {
    # zero is meaningful: no warm-up, no activation compression, no clipping or decay, seed 0,
    # raw entropy means, a learning-rate floor of 0, no compression-rate threshold, every
    # bucket a unit
    *[(f, "0") for f in ("--lr-warmup-steps", "--activation-rank", "--seed", "--edgc-seed", "--edgc-warmup-steps",
                         "--edgc-warmup-min-steps", "--edgc-max-units",
                         "--max-restarts")],
    *[(f, "0") for f in ("--grad-clip", "--weight-decay", "--min-lr", "--edgc-cqm-smoothing",
                         "--edgc-min-compression-rate", "--edgc-min-unit-mb", "--dac-eta", "--dac-intercept",
                         "--dac-t-mb", "--dac-t-uncompressed")],
    ("--emulated-device-ms", "0"),  # off, the default
    ("--diloco-outer-momentum", "0"),  # DiLoCo's outer step without momentum: plain SGD
    ("--diloco-inner-steps", str(10**12)),  # H past the run's end: no outer step at all, the user's call
    ("--diloco-outer-lr", "1e12"),  # an outer step that diverges, as a huge --lr does
    ("--dac-intercept", "-1"),  # T = eta·r + c: a negative offset is a fitted value like any other
    # large counts and sizes are the user's call: a long run, rare evaluations and
    # checkpoints, a large cap (memory and time are theirs, as with any trainer)
    *[(f, str(10**12)) for f in ("--steps", "--stop-after", "--lr-warmup-steps", "--eval-every", "--eval-tokens",
                                 "--checkpoint-every", "--corpus-bytes", "--edgc-window", "--edgc-warmup-steps",
                                 "--dac-max-samples", "--nproc", "--dp", "--dp-shard", "--dp-replicate", "--batch-size",
                                 "--grad-accum",
                                 "--block-size", "--vocab-size", "--keep-checkpoints", "--max-restarts",
                                 "--max-nonfinite-steps")],
    # a huge but finite float: a learning rate or decay that diverges, clipping that never
    # clips, a threshold no matrix meets, a unit that is the whole step, given timings
    *[(f, "1e12") for f in ("--lr", "--weight-decay", "--grad-clip", "--edgc-min-compression-rate",
                            "--edgc-min-unit-mb", "--dac-eta", "--dac-intercept", "--dac-t-mb",
                            "--dac-t-uncompressed")],
    ("--edgc-schedule-ranks", ""),  # no schedule: the default, for every policy but "schedule"
    ("--lr-drop-steps", ""),  # no drops: the default, for every lr schedule but "step"
    ("--edgc-critical-threshold", "1e12"),  # a change never that large: r_lo but after learning-rate drops
}


def _train_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["train"]


def _field_of(dest: str):
    """(config class, field name) behind a train flag's dest (a section's field of
    EDGCConfig, "noise_exponent", as (NoiseConfig, "exponent"))."""
    for prefix, cls in (("edgc__", EDGCConfig), ("dac__", DACConfig), ("expert_edgc__", EDGCConfig),
                        ("", TrainConfig)):
        if dest.startswith(prefix):
            name = dest[len(prefix):]
            section, _, option = name.partition("_")
            if cls is EDGCConfig and name not in field_types(cls) and section in SECTIONS:
                return SECTIONS[section], option
            return cls, name


# (the flags that are no config field: what to do with the run folder, not how to train)
FLAGS = [a for a in _train_parser()._actions
         if a.option_strings and a.dest not in ("help", "config", "resume", "auto_resume", "overwrite")]


def _bad_values(cls, name: str) -> list[str]:
    ftype = field_types(cls)[name]
    if ftype.kind is bool:
        return BAD_BOOL
    if name in getattr(cls, "CHOICES", {}):
        return BAD_CHOICE
    return {int: BAD_INT, float: BAD_FLOAT, str: BAD_TEXT}[ftype.kind]


def _hashes(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A working directory holding a run (so a valid command stops at "already holds a run")
    and a plain file; training is made impossible, so a test bug cannot start workers."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"steps": 2}))
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    (run / CHECKPOINT_NAME).write_bytes(b"not really a checkpoint")
    (tmp_path / "afile").write_text("a file, not a folder")
    monkeypatch.chdir(tmp_path)

    def no_training(*args, **kwargs):
        raise AssertionError("bad input reached the workers")

    monkeypatch.setattr("edgc.train.trainer.run_local", no_training)
    return tmp_path


def _run(argv: list[str], capsys) -> tuple[int, str]:
    """main(argv)'s exit status and its stderr (argparse's errors exit via SystemExit)."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return code, captured.err


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("edgc train: error: "), err
    return lines[0]


def test_every_flag_is_a_config_field():
    # a flag that is not a field would get no bad values below: cover it here first
    assert len(FLAGS) > 60
    for action in FLAGS:
        cls, name = _field_of(action.dest)
        assert name in field_types(cls), action.option_strings


@pytest.mark.parametrize("action", FLAGS, ids=lambda a: a.option_strings[0])
def test_bad_values_of_every_flag_end_in_one_line(action, workdir, capsys):
    flag = action.option_strings[0]
    cls, name = _field_of(action.dest)
    before = {p.name for p in workdir.iterdir()}, _hashes(workdir / "run")
    values = [v.replace("{file}", str(workdir / "afile")) for v in _bad_values(cls, name)]
    for value in values:
        code, err = _run(["train", "--out", "run", f"{flag}={value}"], capsys)
        if (flag, value) in ALLOWED:
            assert code in (0, 2) and len(err.strip().splitlines()) <= 1, (flag, value, err)
            continue
        line = _one_line(err)
        assert code == 2, (flag, value, err)
        assert "already holds a run" not in line, f"{flag}={value!r} was accepted"
        assert flag in line or f"{name}=" in line or f"{name}(" in line, (flag, value, line)  # ("pp(2) * dp(1)")
    if field_types(cls)[name].kind is bool:  # the --no- form takes no value
        code, err = _run(["train", "--out", "run", f"{action.option_strings[1]}=true"], capsys)
        assert code == 2 and "takes no value" in _one_line(err)
    assert ({p.name for p in workdir.iterdir()}, _hashes(workdir / "run")) == before


# The flags that say which run, not how to train: their bad values, by hand (a new flag of
# this kind fails the test below until it is given some here).
RUN_FLAG_BAD = {
    "--config": ["", " ", "nothere.toml", "{file}", "{file}/sub", "run", "run/config.json/x"],
    "--resume": ["", " ", "nothere", "{file}", "{file}/sub", "run", "run/config.json", "run/nothere.pt"],
    "--auto-resume": ["true", ""],  # (flags without a value)
    "--overwrite": ["true", ""],
}


def test_bad_values_of_the_run_flags_end_in_one_line(workdir, capsys):
    others = {a.option_strings[0] for a in _train_parser()._actions if a.option_strings and a.dest != "help"}
    assert others - {a.option_strings[0] for a in FLAGS} == set(RUN_FLAG_BAD)
    before = {p.name for p in workdir.iterdir()}, _hashes(workdir / "run")
    for flag, values in RUN_FLAG_BAD.items():
        for value in values:
            value = value.replace("{file}", str(workdir / "afile"))
            code, err = _run(["train", f"{flag}={value}", "--steps", "3"], capsys)
            line = _one_line(err)
            assert code == 2 and "already holds a run" not in line, (flag, value, line)
    assert ({p.name for p in workdir.iterdir()}, _hashes(workdir / "run")) == before


def test_resume_of_a_file_that_is_not_a_checkpoint_says_so(workdir, capsys):
    # (it said "checkpoint ... is corrupt or truncated (BadZipFile: File is not a zip file)")
    (workdir / "random.pt").write_bytes(os.urandom(4096))
    (workdir / "empty.pt").write_bytes(b"")
    (workdir / "notes.txt").write_text("a text file\n")
    torch.save({"weights": torch.zeros(3)}, workdir / "foreign.pt")  # a torch file, not edgc's
    for given, path in (("afile", "afile"), ("random.pt", "random.pt"), ("empty.pt", "empty.pt"),
                        ("notes.txt", "notes.txt"), ("foreign.pt", "foreign.pt"),
                        ("run", f"run/{CHECKPOINT_NAME}"), ("run/config.json", "run/config.json")):
        for flag in (["--resume", given], ["--auto-resume", "--out", given]):
            if flag[0] == "--auto-resume" and not (workdir / given).is_dir():
                continue
            code, err = _run(["train", *flag], capsys)
            assert code == 2 and _one_line(err) == f"edgc train: error: {path!r} is not an edgc checkpoint", err
    # a checkpoint cut short is still one (its first bytes are): corrupt or truncated
    save_checkpoint(workdir / "real.pt", {"step": 1, "w": torch.randn(1000)})
    (workdir / "cut.pt").write_bytes((workdir / "real.pt").read_bytes()[:2000])
    code, err = _run(["train", "--resume", "cut.pt"], capsys)
    assert code == 2 and "edgc train: error: checkpoint 'cut.pt' is corrupt or truncated" in _one_line(err)


def test_allowed_pairs_name_real_flags_and_listed_values():
    # (keeps the allow-list honest: an entry for a renamed flag or value would excuse nothing)
    flags = {a.option_strings[0]: a for a in FLAGS}
    for flag, value in ALLOWED:
        assert flag in flags, flag
        cls, name = _field_of(flags[flag].dest)
        assert value in _bad_values(cls, name), (flag, value)


def test_valid_values_still_reach_the_run_check(workdir, capsys):
    # the control: a valid command is refused only because --out holds a run
    code, err = _run(["train", "--out", "run", "--lr", "3e-4", "--steps", "524_288", "--edgc-bins", "1048576",
                      "--edgc-iteration-sample-rate", "1e-6", "--edgc-max-rank", "65536", "--rank", "65536",
                      "--edgc-warm-start", "false", "--no-progress", "--dac-eta", "null"], capsys)
    assert code == 2 and "already holds a run" in _one_line(err)


# ---------------------------------------------------------------- typed values reach the options


def _options(*argv: str) -> dict:
    return _given_options(build_parser().parse_args(["train", *argv]))


def test_flags_are_parsed_by_their_field_type():
    o = _options("--out", "2024", "--steps", "3", "--lr", "1e-3", "--bucket-cap-mb", "2", "--eval-tokens", "524_288",
                 "--edgc-max-rank", "8", "--edgc-schedule-ranks", "0:8", "--edgc-noise-exponent", "1",
                 "--dac-intercept", "-0.5")
    assert o["out"] == "2024" and o["steps"] == 3 and o["eval_tokens"] == 524_288
    assert type(o["lr"]) is float and o["lr"] == 1e-3 and type(o["bucket_cap_mb"]) is float
    assert o["edgc"] == {"max_rank": 8, "schedule_ranks": "0:8", "noise_exponent": 1.0}
    assert type(o["edgc"]["noise_exponent"]) is float and o["dac"] == {"intercept": -0.5}
    assert TrainConfig.from_dict(o).out == "2024"


def test_only_given_flags_are_options_and_null_is_given_as_none():
    assert _options() == {"edgc": {}, "dac": {}, "expert_edgc": {}}
    o = _options("--stop-after", "null", "--corpus-bytes", "None", "--edgc-max-rank", "null", "--dac-eta", "none")
    assert o == {"stop_after": None, "corpus_bytes": None, "edgc": {"max_rank": None}, "dac": {"eta": None},
                 "expert_edgc": {}}


def test_bool_flags():
    assert _options("--no-progress", "--sync-after-send")["progress"] is False
    assert _options("--sync-after-send")["sync_after_send"] is True
    assert _options("--edgc-differential", "false")["edgc"] == {"differential": False}
    assert _options("--dac-cap-at-r-max", "FALSE")["dac"] == {"cap_at_r_max": False}
    assert _options("--no-edgc-warm-start")["edgc"] == {"warm_start": False}


def test_null_is_refused_where_the_field_takes_no_none(capsys):
    code, err = _run(["train", "--steps", "null"], capsys)
    assert code == 2 and _one_line(err) == "edgc train: error: argument --steps: expected an integer, got 'null'"


def test_compile_refuses_ddp_buckets_smaller_than_torch_compile_splits_at(workdir, capsys):
    code, err = _run(["train", "--out", "new", "--compile", "--bucket-cap-mb", "0.5"], capsys)
    assert code == 2 and _one_line(err) == (
        "edgc train: error: bucket_cap_mb=0.5: must be at least 1 with --compile: torch.compile splits a DDP "
        "model's graph at buckets of this size and refuses any smaller than 1 MB")
    assert not (workdir / "new").exists()
    TrainConfig(compile=True, bucket_cap_mb=1.0).validate()
    TrainConfig(compile=True, bucket_cap_mb=0.5, dp_shard=2, dp_replicate=1).validate()  # (HSDP: no DDP buckets)
    TrainConfig(compile=False, bucket_cap_mb=0.5).validate()


def test_unknown_flag_is_one_line(capsys):
    code, err = _run(["train", "--lr", "1e-3", "--learning-rate", "3"], capsys)
    assert code == 2 and _one_line(err) == "edgc train: error: unrecognized arguments: --learning-rate 3"


# ---------------------------------------------------------------- --out


def test_out_must_be_a_folder_or_makeable(workdir, capsys):
    code, err = _run(["train", "--out", "afile"], capsys)
    assert code == 2 and _one_line(err) == "edgc train: error: out='afile': is a file, not a folder"
    code, err = _run(["train", "--out", "afile/run"], capsys)
    assert code == 2 and "lies under 'afile', which is a file" in _one_line(err)
    with pytest.raises(ValueError, match="data_cache='afile/x': lies under"):
        TrainConfig(data_cache="afile/x").validate()
    TrainConfig(out="new/deeper/run").validate()  # a folder that can be made is fine (and is not made)
    assert not (workdir / "new").exists()


def test_a_read_only_out_is_refused_before_anything_runs(tmp_path):
    # (it used to fail only at the first checkpoint, after training; then with a traceback
    # at the run folder's lock)
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "old.txt").write_text("kept")
    ro.chmod(0o555)
    command = [sys.executable, "-m", "edgc", "train", "--data", "nothere", "--no-progress"]
    if os.geteuid() == 0:  # root writes anywhere; as the unmapped user of a new user namespace it does not
        if shutil.which("unshare") is None or subprocess.run(["unshare", "--user", "true"]).returncode:
            pytest.skip("running as root, and no user namespace to drop the right to write anywhere")
        command = ["unshare", "--user", *command]
    try:
        for out, where in (("ro", "this folder"), ("ro/run", "'ro', where it would be made,")):
            proc = subprocess.run([*command, "--out", out], cwd=tmp_path, capture_output=True, text=True, timeout=120)
            assert proc.returncode == 2 and proc.stdout == "", proc.stderr
            assert proc.stderr == f"edgc train: error: out={out!r}: cannot be written: {where} is read-only here " \
                                  "(a read-only file system or no write permission)\n"
        # a data cache that still has the built-in corpus to prepare must be writable too (it
        # gave a bare PermissionError from the tokeniser, after the run folder was made)
        (tmp_path / "w").mkdir(mode=0o777)
        (tmp_path / "w").chmod(0o777)  # (the run folder's parent: writable by anyone)
        proc = subprocess.run([*command[:-3], "--data-cache", "ro/cache", "--out", "w/run"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and proc.stderr == (
            "edgc train: error: data_cache='ro/cache': cannot be written: 'ro', where it would be made, is "
            "read-only here (a read-only file system or no write permission)\n"), proc.stderr
        assert not (tmp_path / "w" / "run").exists()
    finally:
        ro.chmod(0o755)
    assert [p.name for p in ro.iterdir()] == ["old.txt"]
    # one that holds it already is only read: accepted
    cached = TrainConfig(data_cache=str(ro)).builtin_data_folder()
    cached.mkdir()
    (cached / "meta.json").write_text("{}")
    ro.chmod(0o555)
    try:
        check = f"from edgc.train.config import TrainConfig; TrainConfig(data_cache={str(ro)!r}).validate()"
        proc = subprocess.run([*command[:-6], "-c", check], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
    finally:
        ro.chmod(0o755)


# ---------------------------------------------------------------- config files


@pytest.mark.parametrize("name,content,message", [
    ("list.json", "[1, 2]", "must hold a table of options (keys and values), not a list"),
    ("broken.json", '{"steps": 3,}', "is not valid JSON: "),
    ("edgc.toml", "edgc = 5", "edgc must be an [edgc] table of options, not the number 5"),
    ("dac.json", '{"dac": [1]}', 'dac must be a "dac" object of options, not the list [1]'),
    ("run.yaml", "steps: 3", "only TOML (.toml) and JSON (.json) config files are supported"),
    ("broken.toml", "steps = ", "is not valid TOML: "),
    ("latin1.toml", b"out = \"caf\xe9\"", "is not UTF-8 text (invalid continuation byte at byte 10)"),
])
def test_config_file_errors_name_the_file(name, content, message, workdir, capsys):
    path = workdir / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    code, err = _run(["train", "--config", name, "--out", "run"], capsys)
    line = _one_line(err)
    assert code == 2 and f"config file '{name}'" in line and message in line, line


def test_config_file_that_is_a_folder_or_missing(workdir, capsys):
    code, err = _run(["train", "--config", "run"], capsys)
    assert code == 2 and _one_line(err) == "edgc train: error: config file 'run' is a folder, not a file"
    code, err = _run(["train", "--config", "nothere.toml"], capsys)
    assert code == 2 and "does not exist" in _one_line(err)


@pytest.mark.parametrize("toml,message", [
    ("steps = true", "steps=True: must be an integer, not true or false"),
    ('lr = "abc"', "lr='abc': must be a finite number"),
    ("lr = nan", "lr=nan: must be a finite number"),
    ("out = 2024", "out=2024: must be text"),
    ("stop_after = 1.5", "stop_after=1.5: must be an integer or null"),
    ("[edgc]\nbins = 1e3", "EDGCConfig.bins=1000.0: must be an integer"),
    ("[edgc]\nmin_compression_rate = inf", "EDGCConfig.min_compression_rate=inf: must be a finite number"),
    ("[dac]\ncap_at_r_max = 1", "dac cap_at_r_max=1: must be true or false"),
    ("[dac]\nmultiple = true", "dac multiple=True: must be an integer, not true or false"),
])
def test_config_file_values_are_checked_by_type(toml, message, workdir, capsys):
    (workdir / "run.toml").write_text(toml)
    out = [] if toml.startswith("out") else ["--out", "run"]  # (a flag would win over the file)
    code, err = _run(["train", "--config", "run.toml", *out], capsys)
    assert code == 2 and message in _one_line(err)


def test_config_file_reads_tables(workdir):
    (workdir / "ok.toml").write_text('steps = 3\nlr = 1\n[edgc]\nwindow = 5\n[dac]\neta = 0.5\n')
    assert load_config_file("ok.toml", tables=("edgc", "dac")) == {
        "steps": 3, "lr": 1, "edgc": {"window": 5}, "dac": {"eta": 0.5}}
    TrainConfig.from_dict(load_config_file("ok.toml")).validate()  # an int is a number where a float belongs


# ---------------------------------------------------------------- the door users use


def _slow(args, message):
    return pytest.param(args, message, marks=pytest.mark.slow)


@pytest.mark.parametrize("args,message", [
    (["--lr", "nan"], "edgc train: error: argument --lr: expected a finite number, got 'nan'"),
    (["--steps", "true"], "edgc train: error: argument --steps: expected an integer, got 'true'"),
    (["--config", "list.json"], "edgc train: error: config file 'list.json' must hold a table of options"),
    (["--out", "afile/run"], "edgc train: error: out='afile/run': lies under 'afile', which is a file"),
    # every other input issue 11 lists (items 9-11), as it was typed
    _slow(["--lr", "inf"], "edgc train: error: argument --lr: expected a finite number, got 'inf'"),
    _slow(["--lr", "1e-3x"], "edgc train: error: argument --lr: expected a finite number, got '1e-3x'"),
    _slow(["--grad-clip", "nan"], "edgc train: error: argument --grad-clip: expected a finite number, got 'nan'"),
    _slow(["--weight-decay", "nan"], "edgc train: error: argument --weight-decay: expected a finite number, got 'nan'"),
    _slow(["--bucket-cap-mb", "NaN"],
          "edgc train: error: argument --bucket-cap-mb: expected a finite number, got 'NaN'"),
    _slow(["--edgc-min-compression-rate", "NaN"],
          "edgc train: error: argument --edgc-min-compression-rate: expected a finite number, got 'NaN'"),
    _slow(["--config", "edgc5.toml"], "edgc train: error: config file 'edgc5.toml': edgc must be an [edgc] table"),
    _slow(["--out", "afile"], "edgc train: error: out='afile': is a file, not a folder"),
    _slow(["--weight-decay", "-5"], "edgc train: error: weight_decay=-5.0: must be >= 0"),
    _slow(["--bucket-cap-mb", "0"], "edgc train: error: bucket_cap_mb=0.0: must be in (0, 1048576] (MB)"),
    _slow(["--bucket-cap-mb", "-1"], "edgc train: error: bucket_cap_mb=-1.0: must be in (0, 1048576] (MB)"),
    _slow(["--config", "config.json"], "edgc train: error: config file 'config.json' is not valid JSON: Expecting"),
    _slow(["--config", "x.yaml"], "edgc train: error: config file 'x.yaml': only TOML (.toml) and JSON (.json)"),
    _slow(["--config", "run"], "edgc train: error: config file 'run' is a folder, not a file"),
    # a file without a suffix is the checkpoint named, not a run folder's (it said "no
    # checkpoint at 'afile/checkpoint.pt'")
    _slow(["--resume", "afile"], "edgc train: error: 'afile' is not an edgc checkpoint"),
    _slow(["--config", "latin1.toml"], "edgc train: error: config file 'latin1.toml' is not UTF-8 text"),
])
def test_python_m_edgc_train_gives_one_line(args, message, workdir):
    (workdir / "list.json").write_text("[1, 2]")
    (workdir / "edgc5.toml").write_text("edgc = 5")
    (workdir / "config.json").write_text('{"steps": 3,}')
    (workdir / "x.yaml").write_text("steps: 3")
    (workdir / "latin1.toml").write_bytes(b'out = "caf\xe9"')
    # (an accepted value would stop at "already holds a run", not train; a given --out wins)
    proc = subprocess.run([sys.executable, "-m", "edgc", "train", "--out", "run", *args], cwd=workdir,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.startswith(message) and proc.stderr.count("\n") == 1, proc.stderr


# ---------------------------------------------------------------- a state dict that lacks keys


def test_load_state_dict_names_the_missing_keys():
    state = EDGCState(None, EDGCConfig(max_rank=4))
    d = state.state_dict()
    with pytest.raises(ValueError, match=r"lacks \['world_size', 'replica', 'config', .*'stats'\]"):
        state.load_state_dict({"format": d["format"], "version": d["version"]})
    for key in ("world_size", "compression", "stats"):
        with pytest.raises(ValueError, match=f"lacks \\['{key}'\\]"):
            state.load_state_dict({k: v for k, v in d.items() if k != key})
    with pytest.raises(ValueError, match=r"'stats' lacks \['comm_seconds'\]"):
        state.load_state_dict({**d, "stats": {k: v for k, v in d["stats"].items() if k != "comm_seconds"}})
    with pytest.raises(ValueError, match=r"'compression' lacks \['generator'\]"):
        state.load_state_dict({**d, "compression": {k: v for k, v in d["compression"].items() if k != "generator"}})
    with pytest.raises(ValueError, match=r"\['config'\] must be tables"):
        state.load_state_dict({**d, "config": 5})
    with pytest.raises(ValueError, match="version 3 is not supported"):
        state.load_state_dict({**d, "version": 3})
    assert state.step == 0 and state.state_dict().keys() == d.keys()  # nothing was changed by the refusals
    state.load_state_dict(d)  # the whole state still loads

