"""Start N local worker processes joined by a gloo process group (the embedded default)."""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["WorkerError", "free_port", "run_local"]


class WorkerError(RuntimeError):
    """A local worker failed, hung past its timeout, or died without reporting."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(fn: Callable, rank: int, world: int, port: int, out_dir: str, threads: int, log_level: int,
            backend: str, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    logging.basicConfig(level=log_level, format=f"%(levelname)s [rank {rank}] %(name)s: %(message)s")

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world)
        result: tuple[str, Any] = ("ok", fn(rank, world, *args))
        gc.collect()  # (see train_distributed: free reference cycles holding gloo work first)
        dist.destroy_process_group()
    except BaseException:  # report every failure to the parent, then exit
        result = ("error", traceback.format_exc())
    tmp = os.path.join(out_dir, f"{rank}.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(result, f)
    os.replace(tmp, os.path.join(out_dir, f"{rank}.pkl"))


def run_local(fn: Callable, nproc: int, *args: Any, timeout: float | None = None, threads: int | None = None,
              backend: str = "gloo") -> list[Any]:
    """Run fn(rank, world, *args) on `nproc` spawned processes; returns results by rank.

    Workers meet over `backend` (gloo, or NCCL with one GPU each) on 127.0.0.1. `fn` must
    be importable (module level). Each worker gets `threads` intra-op threads (default:
    the cores shared out evenly).
    Raises WorkerError with the failing worker's traceback; on a timeout or Ctrl-C every
    worker is killed, so nothing is left running.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    threads = threads or max(1, (os.cpu_count() or 1) // nproc)
    ctx = mp.get_context("spawn")
    log_level = logging.getLogger().getEffectiveLevel()  # workers log like the parent
    with tempfile.TemporaryDirectory(prefix="edgc-workers-") as out_dir:
        port = free_port()
        procs = [
            ctx.Process(target=_worker, args=(fn, r, nproc, port, out_dir, threads, log_level, backend, args), daemon=False)
            for r in range(nproc)
        ]
        try:
            for p in procs:
                p.start()
            deadline = None if timeout is None else time.monotonic() + timeout
            _join_all(procs, out_dir, deadline)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
        return _collect(procs, out_dir)


def _join_all(procs: list, out_dir: str, deadline: float | None) -> None:
    """Wait for all workers; stop early when one reports an error (the rest may hang)."""
    while any(p.is_alive() for p in procs):
        for r, p in enumerate(procs):
            if not p.is_alive() and p.exitcode != 0:
                return
            path = os.path.join(out_dir, f"{r}.pkl")
            if not p.is_alive() or not os.path.exists(path):
                continue
            with open(path, "rb") as f:
                if pickle.load(f)[0] != "ok":
                    time.sleep(1.0)  # let the others report their own view
                    return
        if deadline is not None and time.monotonic() > deadline:
            alive = [r for r, p in enumerate(procs) if p.is_alive()]
            raise WorkerError(f"workers {alive} did not finish in time (hang or deadlock); all were killed")
        time.sleep(0.05)


def _collect(procs: list, out_dir: str) -> list[Any]:
    results, errors = [], []
    for r, p in enumerate(procs):
        path = os.path.join(out_dir, f"{r}.pkl")
        if not os.path.exists(path):
            errors.append(f"worker {r} died without a result (exit code {p.exitcode})")
            continue
        with open(path, "rb") as f:
            status, value = pickle.load(f)
        if status != "ok":
            errors.append(f"worker {r} failed:\n{value}")
        results.append(value)
    if errors:
        # a worker that crashed takes its peers down with "Connection closed by peer"
        # errors; show the cause first, whichever rank it was on
        errors.sort(key=lambda e: "Connection closed by peer" in e or "died without a result" in e)
        raise WorkerError("\n".join(errors[:2]))
    return results
