#!/usr/bin/env bash
# Create .venv with edgc and its test tools. torch is pinned here (not in pyproject) to the
# CPU build this project's machines carry; override with EDGC_TORCH="torch==X" for others.
# The optional extras are installed too, so that the tests of each one run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
if ! .venv/bin/python -c "import edgc, torch, pytest, tensorboard" 2>/dev/null; then
    .venv/bin/python -m pip install -q --disable-pip-version-check "${EDGC_TORCH:-torch==2.13.0}"
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev,tensorboard]"
fi
