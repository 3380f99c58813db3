"""Every relative link in the repository's Markdown resolves: `[text](path)` names a file or
folder the repository holds (relative to the Markdown file; "/path" from the repository's
root), and `path#anchor` or `#anchor` names a heading of that Markdown file, by GitHub's
slug rules. External links (http, https, mailto, ...) are not followed."""

import re
import subprocess
import unicodedata
from functools import cache
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[2]

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](target) and ![alt](target); the text may hold one level of brackets
INLINE = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]"  # the text
                    r"\(\s*(<[^>]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)"  # the target: <...>, or balanced ()
                    r"(?:\s+[\"'(][^)]*)?\)")  # an optional title
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=[\"']([^\"']+)[\"']", re.I)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...


def _git_files(*patterns: str) -> list[str]:
    """The files git tracks or would add (not ignored), as in a clone: those still on disk."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *patterns],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return sorted({f for f in out.split("\0") if f and (ROOT / f).is_file()})


@cache
def _repository() -> tuple[frozenset[str], frozenset[str]]:
    """The repository's files and folders, as paths relative to its root."""
    files = frozenset(_git_files())
    folders = {""}
    for f in files:
        parts = f.split("/")[:-1]
        folders.update("/".join(parts[: i + 1]) for i in range(len(parts)))
    return files, frozenset(folders)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: the text as shown (links' text, no emphasis or
    code marks), lowercased, every character dropped but letters, digits, marks, spaces,
    '-' and '_', and each space made a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link or image: its text
    text = re.sub(r"<[^>]+>", "", text).lower()  # inline HTML
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return kept.replace(" ", "-")


def anchors_in(text: str) -> frozenset[str]:
    """The anchors of a Markdown text: its headings' slugs (a repeated one numbered -1,
    -2, ... as GitHub does) and any <a name/id="...">."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for line in _numbered_prose(text, blank_spans=False):
        found.update(HTML_ANCHOR.findall(line))
        heading = HEADING.match(line)
        if not heading:
            continue
        base = slug(heading.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


@cache
def anchors(path: str) -> frozenset[str]:
    """The anchors of the repository's Markdown file `path`."""
    return anchors_in((ROOT / path).read_text(encoding="utf-8"))


def links_in(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link in a Markdown text, code left out."""
    out = []
    for number, line in enumerate(_numbered_prose(text), 1):
        targets = [m.group(1) for m in INLINE.finditer(line)]
        ref = REFERENCE.match(line)
        if ref:
            targets.append(ref.group(1))
        out.extend((number, t[1:-1] if t.startswith("<") else t) for t in targets)
    return out


def _numbered_prose(text: str, blank_spans: bool = True) -> list[str]:
    """The lines of `text`, a fenced block's lines blank (so line numbers stay the file's),
    and with `blank_spans` each code span replaced by a word."""
    out: list[str] = []
    fence = None
    for line in text.splitlines():
        found = FENCE.match(line)
        if fence is None:
            if found:
                fence = found.group(1)
                out.append("")
            else:
                out.append(CODE_SPAN.sub("code", line) if blank_spans else line)
        else:
            if found and found.group(1)[0] == fence[0] and len(found.group(1)) >= len(fence) \
                    and not line.strip().strip(fence[0]):
                fence = None
            out.append("")
    return out


def broken(path: str, target: str) -> str | None:
    """Why `target`, linked from the Markdown file `path`, does not resolve, or None."""
    if not target or EXTERNAL.match(target):
        return None
    where, _, anchor = target.partition("#")
    where = unquote(where)
    files, folders = _repository()
    if where:
        base = "" if where.startswith("/") else path.rpartition("/")[0]
        resolved = _normal(base, where)
        if resolved is None:
            return "points outside the repository"
        if resolved not in files and resolved not in folders:
            return "no such file or folder in the repository"
    else:
        resolved = path
    if anchor and resolved in files and resolved.endswith(".md") and unquote(anchor) not in anchors(resolved):
        return f"no heading #{anchor} in {resolved}"
    return None


def _normal(base: str, where: str) -> str | None:
    """`where` joined to the folder `base` (from the repository's root), with "." and ".."
    folded; None where it climbs out of the repository."""
    parts = [p for p in base.split("/") if p]
    for part in where.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                return None
            parts.pop()
        else:
            parts.append(part)
    return "/".join(parts)


def test_slug_follows_githubs_rules():
    assert slug("Long runs (10,000 steps)") == "long-runs-10000-steps"
    assert slug("One round trip per step: `alternate`") == "one-round-trip-per-step-alternate"
    assert slug("`noise` (the default)") == "noise-the-default"
    assert slug("γ 0.35: time") == "γ-035-time"
    assert slug("What is [linked](x.md) here") == "what-is-linked-here"
    assert slug("snake_case and -dash-") == "snake_case-and--dash-"


def test_links_skip_code_and_keep_line_numbers():
    text = ("See [a](a.md#top) and ![b](img/b.png \"title\").\n```bash\n[no](skipped.md)\n```\n"
            "`[no](span.md)` [c](https://example.com) [d](<d e.md>) [`e`](e/)\n[ref]: ref.md\n")
    assert links_in(text) == [(1, "a.md#top"), (1, "img/b.png"), (5, "https://example.com"), (5, "d e.md"),
                              (5, "e/"), (6, "ref.md")]


def test_anchors_number_repeated_headings_and_skip_code():
    text = ("# Top\n## Notes\n```bash\n# a comment, not a heading\n```\n## Notes\n<a name=\"here\"></a>\n"
            "### `edgc bench`\n")
    assert anchors_in(text) == {"top", "notes", "notes-1", "here", "edgc-bench"}


def test_broken_resolves_relative_to_the_page():
    assert broken("docs/ddp.md", "method.md#how-replicas-stay-in-step") is None
    assert broken("docs/ddp.md", "../README.md") is None
    assert broken("docs/ddp.md", "../benchmarks/results/") is None
    assert broken("docs/ddp.md", "no-such-page.md") is not None
    assert broken("docs/ddp.md", "method.md#no-such-heading") is not None
    assert broken("docs/ddp.md", "../../outside.md") is not None
    assert broken("docs/ddp.md", "https://example.com/x.md") is None


def test_every_relative_link_resolves():
    pages = _git_files("*.md")
    assert "README.md" in pages
    bad = [f"{page}:{line}: ({target}) {why}" for page in pages
           for line, target in links_in((ROOT / page).read_text(encoding="utf-8"))
           if (why := broken(page, target)) is not None]
    assert not bad, f"{len(bad)} broken link(s):\n" + "\n".join(bad)


def test_every_results_page_is_in_benchmarks_index():
    """Each page written into a results folder (benchmarks/results/FOLDER/PAGE.md) is listed in
    BENCHMARKS.md's "All result pages" table, so that a page is found from the index; raw
    `edgc bench` outputs saved beside them (bench-*.md) need only a link from a listed page."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    table = text[text.index("## All result pages"):]
    listed = {ROOT / unquote(t) for t in re.findall(r"\]\((benchmarks/results/[^)#\s]+\.md)\)", table)}
    linked = {(page.parent / unquote(t)).resolve() for page in listed if page.is_file()
              for t in re.findall(r"\]\(([^)#\s:]+\.md)(?:#[^)]*)?\)", page.read_text())}
    pages = [ROOT / f for f in _git_files("benchmarks/results/*.md") if f.count("/") == 3]
    missing = [str(p.relative_to(ROOT)) for p in pages
               if p not in listed and not (p.name.startswith("bench-") and p.resolve() in linked)]
    assert not missing, f"results pages missing from BENCHMARKS.md's \"All result pages\" table: {missing}"
