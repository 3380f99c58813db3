#!/usr/bin/env bash
# Set up, then lint (ruff) and type-check (mypy) as CI does. Both run even when the first
# fails, and the script fails if either one does. Their settings are in pyproject.toml.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
status=0
.venv/bin/python -m ruff check . || status=1
.venv/bin/python -m mypy || status=1
exit "$status"
