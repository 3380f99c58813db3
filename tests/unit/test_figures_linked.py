"""Measured figures have one home: BENCHMARKS.md and the results pages it links. A reference
page (the README, docs/) that quotes a measured ratio, loss difference, loss ± SE or
speed-up links to where it was measured, in the same paragraph, table or the one beside it;
a figure worked out by arithmetic or by `edgc simulate`'s model rather than measured is marked
`<!-- derived -->`."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# 0.28x, 0.81×; +0.0034, −0.0015, -0.0015; 4.1324 ± 0.0095; 16.9% faster; 9.39 ms, 3.2 s (times with a
# decimal only: a whole number of ms or s is more often a setting, a timeout or a budget)
FIGURE = re.compile(r"(?<![\w.])\d+\.\d+[x×](?!\w)|(?<![\w.])[+−-]\d\.\d{3,4}\b|\d\.\d+ ± \d"
                    r"|\b\d+(?:\.\d+)?% (?:faster|slower|less|fewer)|(?<![\w.])\d+\.\d+ m?s\b")
WHERE = re.compile(r"\]\((?:\.\./)*(?:BENCHMARKS\.md|benchmarks/results/)[^)]*\)|<!-- derived -->")


def _units(text: str) -> list[tuple[int, str]]:
    """(line, paragraph) of a page, code blocks left out."""
    text = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    out, line = [], 1
    for para in re.split(r"\n[ \t]*\n", text):
        out.append((line, para))
        line += para.count("\n") + 2
    return out


def unlinked_figures(text: str) -> list[tuple[int, list[str]]]:
    """The paragraphs of `text` that quote a measured figure with no link to where it was
    measured in them or in the paragraph before or after."""
    units = _units(text)
    bad = []
    for i, (line, para) in enumerate(units):
        found = FIGURE.findall(para)
        near = "\n".join(p for _, p in units[max(i - 1, 0): i + 2])
        if found and not WHERE.search(near):
            bad.append((line, found))
    return bad


def test_the_check_sees_a_figure_without_its_source_and_accepts_one_with_it():
    assert unlinked_figures("It sends 0.28x the bytes.\n") == [(1, ["0.28x"])]
    assert unlinked_figures("It ends +0.0034 above it.\n\nOther text.\n") == [(1, ["+0.0034"])]
    assert unlinked_figures("0.81× the bytes, -0.0021 lower, in 217.7 ms or 3.2 s.\n") == [
        (1, ["0.81×", "-0.0021", "217.7 ms", "3.2 s"])]
    assert not unlinked_figures("buckets of 25 MB, a 50 ms queue, version 2.13.0, r(m - n).\n")
    assert not unlinked_figures("It sends 0.28x the bytes ([int8](BENCHMARKS.md#int8)).\n")
    assert not unlinked_figures("| a | 4.1324 ± 0.0095 |\n\n→ [run](../benchmarks/results/x.md)\n")
    assert not unlinked_figures("2 bytes over 4 is 0.50x <!-- derived -->\n")
    assert not unlinked_figures("```\nedgc report: 0.28x\n```\n")


def test_reference_pages_link_every_measured_figure_to_where_it_was_measured():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    problems = [f"{page.relative_to(ROOT)}:{line}: {', '.join(found)}"
                for page in pages for line, found in unlinked_figures(page.read_text())]
    assert not problems, ("measured figures without a link to BENCHMARKS.md or a results page "
                          "(or <!-- derived --> for arithmetic):\n" + "\n".join(problems))
