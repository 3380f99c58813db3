#!/usr/bin/env bash
# Create .venv with edgc, its test and lint tools and every optional extra (the trainer's, TensorBoard,
# and the frameworks edgc.integrations adapts to: Lightning, Hugging Face's, torchtitan), so that the
# tests of each one run, in CI too.
# torch is pinned here (not in pyproject, which asks for >= 2.11) to 2.13.0, whose CPU build
# this project's machines carry; override with EDGC_TORCH="torch==X" for others. An existing .venv that lacks any of them
# gets them on the next run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# (the extras and the lint tools are looked up, not imported: importing them takes seconds;
# edgc.extras lists the train extra's modules)
if ! .venv/bin/python -c "import edgc, torch, pytest, importlib.util as u, sys
from edgc.extras import missing_modules
sys.exit(bool(missing_modules('train')) or any(u.find_spec(m) is None for m in
         ('tensorboard', 'lightning', 'transformers', 'accelerate', 'ruff', 'mypy')
         + (('torchtitan',) if sys.version_info >= (3, 11) else ())))" 2>/dev/null; then
    .venv/bin/python -m pip install -q --disable-pip-version-check "${EDGC_TORCH:-torch==2.13.0}"
    # (the torchtitan extra pins torchtitan, which needs Python 3.11; on 3.10 it installs nothing)
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev,train,tensorboard,lightning,hf,torchtitan]"
fi
