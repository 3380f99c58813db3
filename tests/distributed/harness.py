"""Run a function on N gloo processes with a hard timeout; shared by the distributed tests."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import traceback
from typing import Any, Callable


def _entry(fn: Callable, rank: int, world: int, init_file: str, out_dir: str, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result: Any
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        result = ("ok", fn(rank, world, *args))
        dist.destroy_process_group()
    except BaseException:  # report any failure to the parent
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_workers(fn: Callable, world: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """fn(rank, world, *args) on `world` spawned processes; returns their results by rank.

    Raises AssertionError with the worker's traceback on failure, and kills every
    worker when `timeout` seconds pass (a hang is a failure, never a stuck test run).
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_entry, args=(fn, r, world, init_file, tmp, args)) for r in range(world)]
        for p in procs:
            p.start()
        import time

        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if hung:
            raise AssertionError(f"workers {hung} did not finish within {timeout}s (hang or deadlock)")
        results = []
        for r in range(world):
            path = os.path.join(tmp, f"{r}.pkl")
            if not os.path.exists(path):
                raise AssertionError(f"worker {r} died without a result (exit code {procs[r].exitcode})")
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise AssertionError(f"worker {r} failed:\n{value}")
            results.append(value)
        return results
