#!/usr/bin/env bash
# The main job: set up, then a short real EDGC training of the tiny GPT-2 on the built-in
# corpus with 2 local gloo workers. Leaves a run folder with summary.md, metrics.jsonl,
# plots and a checkpoint. Extra arguments go to `edgc train`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/edgc train --method edgc --steps 300 --nproc 2 --out "runs/demo-$(date +%Y%m%d-%H%M%S)" "$@"
