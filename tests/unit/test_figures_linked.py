"""Measured figures have one home: BENCHMARKS.md and the results pages it links. A reference
page (the README, docs/) that quotes a measured ratio, loss difference, loss ± SE or
speed-up links to where it was measured, in the same paragraph, table or the one beside it;
a figure worked out by arithmetic or by `edgc simulate`'s model rather than measured is marked
`<!-- derived -->`. And a measured figure is stated on its results page and on at most one
other page of the README, BENCHMARKS.md, CHANGELOG.md and docs/ (BENCHMARKS.md's answer, as a
rule), and within BENCHMARKS.md in one answer: the other pages link to it."""

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


# --- one home: a measured figure on its results page and on at most one other page -------

# Counted for repeats: a ratio (0.243x), a loss or a difference of four decimals with or
# without its sign (4.1324, 0.0052 below) or of three with it (+0.022), a percentage with a
# decimal (96.2%), and a time, size or rate with one (4.82 ms, 407.1 MB, 3.57 GB/s, 13.95 h).
# A figure is the same whatever its sign or spelling: −0.0052, -0.0052, +0.0052 and 0.0052
# are one; 0.28× and 0.28x are one.
REPEATED = re.compile(r"(?<![\w.])\d+\.\d+[x×](?!\w)|(?<![\w.])[+−-]?\d\.\d{4}(?![\d.])"
                      r"|(?<![\w.])[+−-]\d\.\d{3}(?![\d.])|(?<![\w.])\d+\.\d+ ?%"
                      r"|(?<![\w.])\d+\.\d+ (?:m?s|[KMG]B(?:/s)?|bytes|h)\b")
CODE_SPAN = re.compile(r"(`+).+?\1")

# Copies this check leaves alone, as (page, figure), each with its reason beside it: none now.
ALLOWED: set[tuple[str, str]] = set()


def figures_in(text: str) -> set[str]:
    """The measured figures of a Markdown text, each in one spelling: code blocks, code
    spans and paragraphs marked <!-- derived --> left out."""
    found = set()
    for _, para in _units(text):
        if "<!-- derived -->" in para:
            continue
        for token in REPEATED.findall(CODE_SPAN.sub(" ", para)):
            found.add(token.replace("−", "-").replace("×", "x").replace(" ", "").lstrip("+-"))
    return found


def repeated_figures(pages: dict[str, str]) -> dict[str, list[str]]:
    """{figure: the pages that state it} for every figure that more than one of `pages`
    ({name: Markdown}) states."""
    where: dict[str, list[str]] = {}
    for name, text in pages.items():
        for figure in figures_in(text):
            if (name, figure) not in ALLOWED:
                where.setdefault(figure, []).append(name)
    return {f: names for f, names in sorted(where.items()) if len(names) > 1}


def test_the_repeat_count_sees_one_figure_in_any_spelling_and_skips_code_and_derived():
    pages = {"a.md": "It ends −0.0052 below, at 0.243× the bytes, 96.2% less.\n",
             "b.md": "It ended 0.0052 lower ([x](BENCHMARKS.md)) with 0.243x; `--lr 0.0052`.\n",
             "c.md": "```\n0.243x\n```\n\n2 over 8 is 0.25x, 96.2% <!-- derived -->\n\nversion 2.13.0, 25 MB, 0.5.\n"}
    assert repeated_figures(pages) == {"0.0052": ["a.md", "b.md"], "0.243x": ["a.md", "b.md"]}
    assert figures_in("407.1 MB and 3.57 GB/s in 4.82 ms; +0.0034, 4.1324 ± 0.0095") == {
        "407.1MB", "3.57GB/s", "4.82ms", "0.0034", "4.1324", "0.0095"}


def test_each_measured_figure_is_on_one_page_beside_its_results_page():
    """A figure measured on a results page is stated on at most one other page: the README,
    docs/ and the CHANGELOG link to BENCHMARKS.md's answer (or say it in words) instead of
    restating it. Two copies outside the results pages are one too many."""
    docs = sorted((ROOT / "docs").glob("*.md"))
    names = ["README.md", "BENCHMARKS.md", "CHANGELOG.md", *(f"docs/{p.name}" for p in docs)]
    repeats = repeated_figures({n: (ROOT / n).read_text() for n in names})
    assert not repeats, ("measured figures stated on more than one page besides their results page; keep each in "
                         "BENCHMARKS.md's answer and link to it:\n"
                         + "\n".join(f"{f}: {', '.join(pages)}" for f, pages in repeats.items()))


# Figures that two answers of BENCHMARKS.md state for two different measurements: the same
# digits by chance.
COINCIDENCES = {
    "0.0101": "the default's gap below the int8 frontier at 1000 steps; its cost on tiny-moe",
    "0.0150": "the default against static rank 32 on small; the dense tiny's paired cost on 4 workers",
    "0.0235": "edgc 0.1's gap below the float32 frontier on pydoc; static rank 32's cost on tiny-moe",
    "1.00x": "the bf16 state against torch's hook's; HSDP's resident memory on tiny",
}


def answers(text: str) -> dict[str, str]:
    """{question: its answer} of a BENCHMARKS.md text: its `## ` sections but the two that
    answer no question (how the figures are measured, the index of result pages)."""
    parts = re.split(r"^## ", text, flags=re.M)[1:]
    return {p.split("\n", 1)[0]: p for p in parts
            if not p.startswith(("How the figures are measured", "All result pages"))}


def _significant_digits(figure: str) -> int:
    return len(re.sub(r"\D", "", figure.split("±")[0]).lstrip("0"))


def test_answers_are_the_questions_sections():
    text = ("# B\n\n## How the figures are measured\n\n0.243x\n\n## Q1?\n\n0.243x\n\n## Q2?\n\n0.243x\n\n"
            "## All result pages\n")
    assert list(answers(text)) == ["Q1?", "Q2?"]
    assert repeated_figures(answers(text)) == {"0.243x": ["Q1?", "Q2?"]}
    assert [_significant_digits(f) for f in ("0.243x", "0.0052", "0.81x", "1.00x", "407.1MB")] == [3, 2, 2, 3, 4]


def test_each_figure_of_benchmarks_is_in_one_answer():
    """Within BENCHMARKS.md a figure is stated in one answer; another answer that needs it
    links to that one. Counted from three significant digits (0.243x, 0.0150, 407.1 MB):
    two-digit figures (0.81x, 0.0034) recur by chance across unrelated measurements."""
    found = repeated_figures(answers((ROOT / "BENCHMARKS.md").read_text()))
    repeats = {f: qs for f, qs in found.items() if _significant_digits(f) >= 3 and f not in COINCIDENCES}
    assert not repeats, ("figures stated in more than one answer of BENCHMARKS.md; keep each in one and link to it "
                         "(or, for two measurements that share their digits, add it to COINCIDENCES):\n"
                         + "\n".join(f"{f}: {' | '.join(qs)}" for f, qs in repeats.items()))
    stale = [f for f in COINCIDENCES if f not in found]
    assert not stale, f"COINCIDENCES no longer needed (remove them): {stale}"
