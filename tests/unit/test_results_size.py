"""benchmarks/results stays small: at most 5 MB of files that git tracks (or would add), and
no plots in run folders. A run folder keeps its config, summary and reports; its plots are
drawn again from its metrics (benchmarks/results/README.md, "Redrawing the plots"). The
only plots kept are the results pages' own: each one embedded or linked by a page of
BENCHMARKS.md's "All result pages" table, and none inside a run's folder (one that holds a
config.json)."""

import os
import re
import subprocess
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[2]
RESULTS = "benchmarks/results"
LIMIT = 5_000_000  # bytes; the folder held 8.6 MB, 6.8 MB of it run folders' plots, when this was set


def _results_files() -> list[str]:
    """The files under benchmarks/results that git tracks or would add (not ignored) and that
    are on disk, as paths from the repository's root."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", RESULTS],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return sorted({f for f in out.split("\0") if f and (ROOT / f).is_file()})


def _pages_plots() -> set[str]:
    """The images that the pages of BENCHMARKS.md's "All result pages" table embed or link,
    as paths from the repository's root."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    table = text[text.index("## All result pages"):]
    pages = {unquote(t) for t in re.findall(r"\]\((benchmarks/results/[^)#\s]+\.md)\)", table)}
    plots = set()
    for page in pages:
        for target in re.findall(r"\]\(([^)\s#]+\.png)\)", (ROOT / page).read_text()):
            plots.add(os.path.normpath(os.path.join(os.path.dirname(page), unquote(target))))
    return plots


def stray_plots(files: list[str], pages_plots: set[str]) -> list[str]:
    """The PNGs among `files` that are not a results page's own plot: not embedded or linked by
    a page of the index (`pages_plots`), or inside a run's folder (a folder of `files` with a
    config.json, or a folder below one)."""
    runs = {os.path.dirname(f) for f in files if os.path.basename(f) == "config.json"}
    return [f for f in files if f.endswith(".png")
            and (f not in pages_plots or any(f.startswith(run + "/") for run in runs))]


def test_stray_plots_are_those_no_page_shows_or_in_a_run_folder():
    files = ["r/d/page.png", "r/d/run/config.json", "r/d/run/loss.png", "r/d/other.png", "r/d/run/sub/x.png"]
    assert stray_plots(files, {"r/d/page.png"}) == ["r/d/run/loss.png", "r/d/other.png", "r/d/run/sub/x.png"]
    assert stray_plots(files, {"r/d/page.png", "r/d/run/loss.png"}) == [
        "r/d/run/loss.png", "r/d/other.png", "r/d/run/sub/x.png"]
    assert stray_plots(["r/d/page.png", "r/d/notes.md"], {"r/d/page.png"}) == []


def test_results_folder_is_at_most_5_mb():
    sizes = {f: (ROOT / f).stat().st_size for f in _results_files()}
    total = sum(sizes.values())
    largest = sorted(sizes, key=sizes.__getitem__, reverse=True)[:10]
    assert total <= LIMIT, (f"{RESULTS} holds {total / 1e6:.2f} MB of tracked files, over {LIMIT / 1e6:.0f} MB; "
                            "the largest:\n" + "\n".join(f"{sizes[f]:>10} {f}" for f in largest))


def test_run_folders_hold_no_plots():
    stray = stray_plots(_results_files(), _pages_plots())
    assert not stray, (f"{len(stray)} plot(s) under {RESULTS} that are no results page's own (embedded by a page "
                       "of BENCHMARKS.md's index, outside any run folder); leave them out, `edgc report` redraws "
                       f"them ({RESULTS}/README.md#redrawing-the-plots):\n" + "\n".join(stray[:20]))
