"""The README's demo image cannot go stale: docs/img/demo-rank.json (written with the image by
benchmarks/demo_image.py from a run of the demo) holds the run's EDGCConfig, which must be
what the demo runs today, and the figures the image's caption quotes."""

import json
import re
from pathlib import Path

from edgc.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
FIGURES = json.loads((ROOT / "docs" / "img" / "demo-rank.json").read_text())


def test_the_image_was_drawn_from_a_run_of_todays_demo():
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    assert FIGURES["command"] in demo.replace(".venv/bin/edgc", "edgc"), "demo_image.py runs another command"
    args = FIGURES["command"].split()
    steps, nproc = int(args[args.index("--steps") + 1]), int(args[args.index("--nproc") + 1])
    today = TrainConfig(method="edgc", steps=steps, nproc=nproc).resolve().edgc_config().to_dict()
    assert json.loads(json.dumps(today)) == FIGURES["edgc"], (
        "the demo's EDGCConfig changed since docs/img/demo-rank.png was drawn: python benchmarks/demo_image.py")


def test_the_caption_quotes_the_runs_figures():
    readme = (ROOT / "README.md").read_text()
    caption = re.search(r"!\[([^\]]*)\]\(docs/img/demo-rank\.png\)", readme)
    assert caption, "README.md shows docs/img/demo-rank.png"
    numbers = [int(n) for n in re.findall(r"\b\d+\b", caption.group(1))]
    assert numbers == [FIGURES["steps_sent_whole"], FIGURES["first_rank"], FIGURES["last_rank"]], caption.group(1)
