"""Start one process per worker of a Cluster, as torchrun would, and wait for all of them."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from edgc.bench.netns import Cluster
from edgc.train.launch import WorkerError, free_port

logger = logging.getLogger(__name__)

__all__ = ["WorkerResult", "run_on_cluster"]


@dataclass
class WorkerResult:
    rank: int
    returncode: int
    output: str  # stdout and stderr together


def run_on_cluster(cluster: Cluster, args: list[str], *, timeout: float,
                   env: dict[str, str] | None = None) -> list[WorkerResult]:
    """Run `python -m edgc ARGS` on every worker with torchrun's environment variables.

    Workers reach each other through the cluster's links (GLOO_SOCKET_IFNAME binds gloo to
    them). Raises WorkerError with the first failing worker's output; on a timeout or
    Ctrl-C every worker is killed.
    """
    port = free_port()  # free on the host; inside fresh namespaces every port is free
    base = {
        **os.environ, **(env or {}),
        "MASTER_ADDR": cluster.addr(0), "MASTER_PORT": str(port), "WORLD_SIZE": str(cluster.n),
        # (the emulated nodes share this machine and its GPUs: local ranks are cluster ranks)
        "LOCAL_WORLD_SIZE": str(cluster.n), "GLOO_SOCKET_IFNAME": cluster.ifname,
        "PYTHONUNBUFFERED": "1",
    }
    with tempfile.TemporaryDirectory(prefix="edgc-cluster-") as tmp:
        logs = [Path(tmp) / f"{r}.log" for r in range(cluster.n)]
        procs = []
        try:
            for r in range(cluster.n):
                with logs[r].open("w") as log:
                    procs.append(subprocess.Popen(
                        cluster.command(r, [sys.executable, "-m", "edgc", *args]),
                        env={**base, "RANK": str(r), "LOCAL_RANK": str(r), "OMP_NUM_THREADS": str(cluster.threads(r))},
                        stdout=log, stderr=subprocess.STDOUT,
                    ))
            deadline = time.monotonic() + timeout
            while any(p.poll() is None for p in procs):
                if any(p.poll() not in (None, 0) for p in procs):
                    time.sleep(2.0)  # give peers a moment to report their side, then stop them
                    break
                if time.monotonic() > deadline:
                    raise WorkerError(f"cluster workers did not finish within {timeout:.0f}s; all were killed")
                time.sleep(0.1)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        results = [WorkerResult(r, p.returncode, logs[r].read_text()) for r, p in enumerate(procs)]
    failed = [w for w in results if w.returncode != 0]
    if failed:
        first = min(failed, key=lambda w: w.rank)
        raise WorkerError(f"worker {first.rank} exited with {first.returncode}:\n{first.output[-4000:]}")
    return results
