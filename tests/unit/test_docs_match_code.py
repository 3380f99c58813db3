"""Lists the docs copy from the code, checked against it so that they cannot drift."""

import argparse
import dataclasses
import re
import subprocess
from pathlib import Path

from edgc.cli import build_parser
from edgc.config import EDGCConfig
from edgc.policy.registry import policy_names
from edgc.train.trainer import RESUME_MAY_CHANGE

ROOT = Path(__file__).resolve().parents[2]


def _flag(name: str) -> str:
    """The command-line option of a RESUME_MAY_CHANGE name ("edgc.min_unit_mb":
    --edgc-min-unit-mb), as resume_config names it."""
    return "--" + name.replace(".", "-").replace("_", "-")


def test_checkpoints_doc_lists_what_a_resume_may_change():
    text = (ROOT / "docs" / "checkpoints.md").read_text()
    found = re.search(r"- \*\*Resume\.\*\*(.*?) may change", text, re.S)
    assert found, "docs/checkpoints.md: no '**Resume.** ... may change' list"
    listed = re.findall(r"`(--[a-z0-9-]+)`", found.group(1))
    assert len(listed) == len(set(listed)), f"listed twice: {listed}"
    assert set(listed) == {_flag(n) for n in RESUME_MAY_CHANGE}


def test_ddp_doc_names_every_edgc_stats_field():
    from edgc.comm.stats import EDGCStats

    text = (ROOT / "docs" / "ddp.md").read_text()
    found = re.search(r"`state\.stats\(\)` returns an `EDGCStats` dataclass:(.*?)Each replica reports", text, re.S)
    assert found, "docs/ddp.md: no '`state.stats()` returns an `EDGCStats` dataclass: ...' paragraph"
    named = set(re.findall(r"`([a-z_]+)`", found.group(1)))
    assert {f.name for f in dataclasses.fields(EDGCStats)} <= named


def _default(cls: type, name: str) -> object:
    f = cls.__dataclass_fields__[name]
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def test_config_doc_gives_every_edgc_config_field_with_its_default_and_choices():
    """docs/config.md's tables: one row per EDGCConfig field, its default as the code has
    it (Python's repr, the doc's double quotes read as single), every value of a text
    field with CHOICES named in its row."""
    text = (ROOT / "docs" / "config.md").read_text()
    rows = re.findall(r"^\| `([a-z_]+)` \| (.*?) \| (.*) \|$", text, re.M)
    names = [name for name, _, _ in rows]
    assert len(names) == len(set(names)), f"a field in two rows: {names}"
    assert set(names) == {f.name for f in dataclasses.fields(EDGCConfig)}
    for name, shown, meaning in rows:
        assert shown.strip("`").replace('"', "'") == repr(_default(EDGCConfig, name)), f"docs/config.md: {name}"
        for choice in EDGCConfig.CHOICES.get(name, ()):
            assert f'"{choice}"' in meaning or f'`"{choice}"`' in shown, f"docs/config.md: {name} omits {choice!r}"
    policies = next(meaning for name, _, meaning in rows if name == "policy")
    assert set(re.findall(r"`([a-z]+)`", policies)) >= set(policy_names()[:6])  # (the built-in ones)


def test_pipelines_doc_names_every_dac_config_field_with_its_default():
    """docs/pipelines.md's DACConfig table: every field in a row (several may share one,
    "`eta`, `intercept`, ..."), each row's default the code's unless it says "measured"."""
    from edgc.policy.dac import DACConfig

    text = (ROOT / "docs" / "pipelines.md").read_text()
    table = text[text.index("## DACConfig"):]
    rows = re.findall(r"^\| ((?:`[a-z_]+`(?:, )?)+) \| (.*?) \| .* \|$", table, re.M)
    names = [n for cell, _ in rows for n in re.findall(r"`([a-z_]+)`", cell)]
    assert len(names) == len(set(names)), f"a field in two rows: {names}"
    assert set(names) == {f.name for f in dataclasses.fields(DACConfig)}
    for cell, shown in rows:
        for name in re.findall(r"`([a-z_]+)`", cell):
            if shown != "measured":
                assert shown.strip("`").replace('"', "'") == repr(_default(DACConfig, name)), f"pipelines.md: {name}"


def _options(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], set[str]]:
    """Each command's (("train",), ("bench", "pareto"), ...) option strings."""
    out: dict[tuple[str, ...], set[str]] = {path: set()}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.update(_options(sub, (*path, name)))
        else:
            out[path].update(action.option_strings)
    return out


#: `edgc COMMAND [SUBCOMMAND] options...` (or after `torchrun ... -m`) at a line's start, in
#: an indented or prompted line, or in backticks.
COMMAND = re.compile(r"(?:^|`|\$ |    )(?:torchrun [^`\n]*?-m )?edgc ([a-z]+(?: [a-z]+)?)([^`\n]*)", re.M)


def test_every_option_the_docs_give_an_edgc_command_exists():
    """Every --option written after `edgc COMMAND` (or `torchrun ... -m edgc COMMAND`) in a
    tracked Markdown page, in code or in backticks, is one that command takes. Options in
    quotes (another command's, as in --method-args "...") and after ` -- ` are left out, and
    so are the dated result pages, which give their commands as they were run then."""
    commands = _options(build_parser())
    pages = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    wrong = []
    for page in (p for p in pages if not p.startswith("benchmarks/results/")):
        text = (ROOT / page).read_text().replace("\\\n", " ")
        for m in COMMAND.finditer(text):
            words = m.group(1).split()
            path = tuple(words[:1])
            if path not in commands:
                continue  # (prose: "edgc is ...")
            if len(words) > 1 and (*path, words[1]) in commands:
                path = (*path, words[1])
            rest = re.sub(r'"[^"]*"', "", m.group(2).split(" -- ")[0])
            for option in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*[a-z0-9])(?![\w-])", rest):
                if option not in commands[path] and option != "--help":
                    wrong.append(f"{page}: edgc {' '.join(path)} {option}")
    assert not wrong, "options the CLI does not take:\n" + "\n".join(wrong)
