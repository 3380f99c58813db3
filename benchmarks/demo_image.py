"""Draw the README's demo image from a run of the demo as it is today.

    python benchmarks/demo_image.py                      # train the demo (scripts/demo.sh's run), then draw
    python benchmarks/demo_image.py --run runs/demo-...  # draw from a demo run already made

It writes docs/img/demo-rank.png (the run's rank plot, as `edgc train` draws it) and
docs/img/demo-rank.json: the command, the run's EDGCConfig and the figures the README's
caption quotes (the steps sent whole, the first rank, the last). tests/unit/test_demo_image.py
compares that config with what the demo runs today and the caption with those figures, so
when the default changes the image must be drawn again.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGE = ROOT / "docs" / "img" / "demo-rank.png"
FIGURES = ROOT / "docs" / "img" / "demo-rank.json"
#: scripts/demo.sh's `edgc train` arguments, without --out
DEMO_ARGS = ["--method", "edgc", "--steps", "300", "--nproc", "2"]


def figures(run: Path) -> dict:
    """The caption's figures from a demo run's metrics and config."""
    from edgc.train.metrics import read_metrics

    train = [r for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "train"]
    ranks = [int(r["rank"]) for r in train]
    whole = next(i for i, r in enumerate(ranks) if r > 0)  # (steps sent whole before the first compressed one)
    config = json.loads((run / "config.json").read_text())
    return {"command": "edgc train " + " ".join(DEMO_ARGS), "steps_sent_whole": whole, "first_rank": ranks[whole],
            "last_rank": ranks[-1], "lowest_rank": min(ranks[whole:]), "edgc": config["edgc"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, default=None, help="a demo run folder (default: train one now)")
    args = parser.parse_args()
    work = None
    run = args.run
    if run is None:
        work = Path(tempfile.mkdtemp(prefix="demo-image-"))
        run = work / "demo"
        subprocess.run([sys.executable, "-m", "edgc", "train", *DEMO_ARGS, "--out", str(run), "--no-progress"],
                       check=True, cwd=ROOT)
    try:
        got = figures(run)
        shutil.copyfile(run / "rank.png", IMAGE)
        FIGURES.write_text(json.dumps(got, indent=2) + "\n")
        print(json.dumps({k: v for k, v in got.items() if k != "edgc"}))
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
