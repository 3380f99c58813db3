"""One version: CHANGELOG.md's top release, `edgc.__version__`, `edgc --version` and the
wheel's version (pyproject.toml takes it from `edgc.__version__`) name the same release."""

import re
import subprocess
import sys
from pathlib import Path

import edgc

ROOT = Path(__file__).resolve().parents[2]


def _changelog_version() -> str:
    """The X.Y.Z of CHANGELOG.md's first "## X.Y.Z" heading (a marker such as "(unreleased)"
    may follow it)."""
    for line in (ROOT / "CHANGELOG.md").read_text().splitlines():
        found = re.match(r"## (\d+\.\d+\.\d+)\b", line)
        if found:
            return found.group(1)
    raise AssertionError("CHANGELOG.md has no '## X.Y.Z' heading")


def test_package_version_is_the_changelogs_top_release():
    assert edgc.__version__ == _changelog_version()


def test_cli_version_is_the_changelogs_top_release():
    out = subprocess.run([sys.executable, "-m", "edgc", "--version"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == f"edgc {_changelog_version()}"


def test_wheel_takes_its_version_from_the_package():
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^dynamic = \["version"\]$', text, re.M)
    assert re.search(r'^version = \{ attr = "edgc.__version__" \}$', text, re.M)


def test_the_torch_bound_is_pyprojects_and_an_older_torch_is_refused_in_one_line():
    from edgc.extras import MIN_TORCH, check_torch

    text = (ROOT / "pyproject.toml").read_text()
    assert f'"torch>={MIN_TORCH[0]}.{MIN_TORCH[1]}"' in text
    check_torch("2.11.0")
    check_torch("2.13.0+cpu")
    check_torch("3.0.0a0+git1234")
    import pytest

    with pytest.raises(ImportError, match=r"edgc needs torch >= 2\.11 .* has torch 2\.10\.1"):
        check_torch("2.10.1")
    out = subprocess.run([sys.executable, "-c", "import torch; torch.__version__ = '2.6.0'; import edgc"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "edgc needs torch >= 2.11" in out.stderr
