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
