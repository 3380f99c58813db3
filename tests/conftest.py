import os
import sys
from pathlib import Path

import pytest

# Spawned workers import tests/distributed/*.py by module name.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "distributed"))

# Workers are forked from a server that imported torch once (edgc.train.launch,
# START_METHOD_ENV), not spawned afresh: half the time of a several-process test here went
# to each worker importing torch. The `edgc` commands the tests run in subprocesses inherit
# it; test_launch.py runs the default, spawn, as well.
os.environ.setdefault("EDGC_START_METHOD", "forkserver")

DISTRIBUTED = Path(__file__).parent / "distributed"


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="also run tests marked slow")
    parser.addoption("--soak-runs", type=int, default=4,
                     help="runs of the slow race soak (tests/distributed/test_soak.py; the issue's goal is 50)")


def is_slow(item: pytest.Item) -> bool:
    """Marked slow, or a several-process test in tests/distributed that is not one of the
    few smoke tests the default run keeps (one through each door users use: the DDP
    hook, `edgc train`, a framework integration)."""
    if "slow" in item.keywords:
        return True
    return item.path.is_relative_to(DISTRIBUTED) and "smoke" not in item.keywords


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if is_slow(item):
            item.add_marker(skip)
