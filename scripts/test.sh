#!/usr/bin/env bash
# Set up, then run the tests. Extra arguments go to pytest (CI adds --runslow).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
