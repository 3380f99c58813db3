"""The README's code blocks that are lines of an example, and those lines.

An example marks the lines the README shows between `# --- readme: NAME ---` and
`# --- readme: end ---`, in one or more segments. The README gives the block a line of its
own before it, `<!-- examples/FILE.py "readme: NAME" -->`; the block is the segments in
order, a blank line between two, each without its leading and trailing blank lines.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# (the README's note before a block, then the fenced block)
_BLOCK = re.compile(r'^<!-- (examples/[\w/]+\.py) "readme: (\w+)" -->\n```python\n(.*?)^```$', re.M | re.S)


def readme_blocks(text: str | None = None) -> dict[tuple[str, str], str]:
    """{(example path, name): the README block's code} for every block the README takes
    from an example."""
    text = README.read_text() if text is None else text
    return {(path, name): code for path, name, code in _BLOCK.findall(text)}


def marked_lines(example: Path, name: str) -> str:
    """The lines `example` marks for the README as `name`, as the README must show them.
    Raises ValueError when there are none, or a segment is not closed."""
    segments: list[list[str]] = []
    current: list[str] | None = None
    for number, line in enumerate(example.read_text().splitlines(), 1):
        if line.strip() == f"# --- readme: {name} ---":
            if current is not None:
                raise ValueError(f"{example}:{number}: a readme segment opened inside another")
            current = []
        elif line.strip() == "# --- readme: end ---" and current is not None:
            segments.append(current)
            current = None
        elif current is not None:
            current.append(line)
    if current is not None:
        raise ValueError(f"{example}: the last 'readme: {name}' segment has no '# --- readme: end ---'")
    if not segments:
        raise ValueError(f"{example}: no '# --- readme: {name} ---' lines")
    return "\n\n".join("\n".join(s).strip("\n") for s in segments) + "\n"
