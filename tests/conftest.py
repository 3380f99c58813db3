import os
import sys

import pytest

# Spawned workers import tests/distributed/*.py by module name.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "distributed"))


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="also run tests marked slow")
    parser.addoption("--soak-runs", type=int, default=10,
                     help="runs of the slow race soak (tests/distributed/test_soak.py; the issue's goal is 50)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
