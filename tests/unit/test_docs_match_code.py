"""Lists the docs copy from the code, checked against it so that they cannot drift."""

import re
from pathlib import Path

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
