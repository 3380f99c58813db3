"""Start N local worker processes joined by a gloo process group (the embedded default)."""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["START_METHOD_ENV", "WorkerError", "die_with_parent", "end_process_group", "free_port", "report_step",
           "run_local"]


class WorkerError(RuntimeError):
    """A local worker failed, hung past its timeout, or died without reporting.

    str() is one line: which worker, how it ended, at which step and why. `details` holds
    the workers' tracebacks; `rank`, `step` and `how` ("error", "signal", "exit",
    "timeout") say what happened, and `cause` is the failing exception's type name.
    """

    def __init__(self, message: str, details: str = "", *, rank: int | None = None, step: int | None = None,
                 how: str = "error", cause: str | None = None) -> None:
        super().__init__(message)
        self.details = details
        self.rank = rank
        self.step = step
        self.how = how
        self.cause = cause


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# this worker's slot in the launcher's shared step counters (set in each local worker)
_step_slot: tuple[Any, int] | None = None


def report_step(step: int) -> None:
    """Tell the local launcher which step this worker is on (for its crash message);
    a no-op outside run_local's workers."""
    if _step_slot is not None:
        _step_slot[0][_step_slot[1]] = step


def die_with_parent(parent: int | None = None, interval: float = 0.5) -> None:
    """End this process soon after its parent dies, however the parent dies: a daemon
    thread checks every `interval` seconds whether this process was handed to another
    parent (init or a subreaper), and then exits at once. Workers call it so that a
    killed launcher (local or torchrun) leaves no orphan training on, writing into the run
    folder. (The kernel's PR_SET_PDEATHSIG would be quicker, but it fires when the parent
    *thread* that started the process ends, so a launcher that starts its workers from a
    short-lived thread would kill them early.)"""
    import threading

    parent = os.getppid() if parent is None else parent
    # (a worker forked by multiprocessing's fork server has that server as its parent: it
    # watches the launcher itself, by its pid)
    forked = os.getppid() != parent

    def alive() -> bool:
        if not forked:
            return os.getppid() == parent
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

    def watch() -> None:
        while alive():
            time.sleep(interval)
        os._exit(1)

    threading.Thread(target=watch, name="edgc-die-with-parent", daemon=True).start()


def end_process_group() -> bool:
    """Destroy the default process group and make sure it is gone before this returns.

    Gloo runs collectives on its own threads, and a thread may drop the last reference to
    a finished collective's tensors a moment after the caller saw it complete. If the
    group is still alive when the interpreter shuts down (a hook state or a reference
    cycle holds it), that drop can land during finalisation, and the process aborts with
    "terminate called without an active exception" although its work succeeded (seen in
    about 1 run of 12 of `edgc bench comm`). Freeing the group here joins those threads
    while Python is alive. Call it once everything that used the group is out of scope.

    Returns False when something still holds the group. DDP does (torch 2.13 keeps about
    ten references to it that no Python object owns, so gc cannot free them); the group
    then lives on, idle: the collections above take milliseconds, far longer than a
    gloo thread needs to drop its last work, which is the window the abort needs.
    """
    import weakref

    import torch.distributed as dist

    if not dist.is_initialized():
        return True
    group = weakref.ref(dist.group.WORLD)
    gc.collect()  # reference cycles (DDP, its reducer and a hook state) holding the group
    dist.destroy_process_group()
    gc.collect()
    if group() is not None:
        logger.debug("the process group outlived destroy_process_group() (DDP keeps references to it)")
        return False
    return True


def _worker(fn: Callable, rank: int, world: int, port: int, out_dir: str, threads: int, log_level: int,
            backend: str, parent: int, steps: Any, args: tuple, env: dict[str, str] | None = None,
            cwd: str | None = None) -> None:
    global _step_slot
    if env is not None:  # (started by the fork server: the launcher's environment and folder now, not the server's)
        os.environ.clear()
        os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    die_with_parent(parent)
    _step_slot = (steps, rank)
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
        result: tuple[str, Any, str] = ("ok", fn(rank, world, *args), "")
        # Keep this: a gloo group left alive at interpreter shutdown can abort a worker after
        # its work succeeded ("terminate called without an active exception"; torch's, not
        # the hook's: a plain DDP script does it too). See end_process_group and
        # docs/integrations.md, "At exit".
        end_process_group()
    except BaseException as exc:  # report every failure to the parent, then exit
        result = ("error", traceback.format_exc(), f"{type(exc).__name__}: {exc}".splitlines()[0])
    tmp = os.path.join(out_dir, f"{rank}.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(result, f)
    os.replace(tmp, os.path.join(out_dir, f"{rank}.pkl"))
    if result[0] == "error":
        # (reported already; a group left alive at shutdown would add gloo's abort to it)
        with contextlib.suppress(Exception):
            end_process_group()


_TEMP_PREFIX = "edgc-workers-"


def _clean_stale_temp() -> None:
    """Remove worker-result folders of launchers that were killed (`edgc-workers-PID-*`
    whose PID no longer runs)."""
    for folder in Path(tempfile.gettempdir()).glob(_TEMP_PREFIX + "*"):
        parts = folder.name[len(_TEMP_PREFIX):].split("-", 1)
        if not (folder.is_dir() and parts[0].isdigit()):
            continue
        try:
            os.kill(int(parts[0]), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass


def run_local(fn: Callable, nproc: int, *args: Any, timeout: float | None = None, threads: int | None = None,
              backend: str = "gloo", log_path: str | Path | None = None,
              on_start: Callable[[list[int]], None] | None = None, strict_exit: bool = False) -> list[Any]:
    """Run fn(rank, world, *args) on `nproc` spawned processes; returns results by rank.

    Workers meet over `backend` (gloo, or NCCL with one GPU each) on 127.0.0.1. `fn` must
    be importable (module level). Each worker gets `threads` intra-op threads (default:
    the cores shared out evenly), and dies with this process, however it ends.
    `on_start(pids)` is called once every worker runs. With `strict_exit`, a worker that
    reported its result but then did not exit cleanly (gloo's abort at interpreter exit)
    fails the run too, as a race soak wants; by default its result counts.
    Raises WorkerError naming the failing worker (its tracebacks in `details`, and
    appended to `log_path` if given); on a failure, a timeout or Ctrl-C every worker is
    killed, so nothing is left running.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    threads = threads or max(1, (os.cpu_count() or 1) // nproc)
    ctx, forked = _start_context()
    log_level = logging.getLogger().getEffectiveLevel()  # workers log like the parent
    _clean_stale_temp()
    steps = ctx.Array("q", nproc, lock=False)
    with tempfile.TemporaryDirectory(prefix=f"{_TEMP_PREFIX}{os.getpid()}-") as out_dir:
        port = free_port()
        procs = [
            ctx.Process(target=_worker, args=(fn, r, nproc, port, out_dir, threads, log_level, backend, os.getpid(),
                                              steps, args, *((dict(os.environ), os.getcwd()) if forked else ())),
                        daemon=False)
            for r in range(nproc)
        ]
        try:
            for p in procs:
                p.start()
            if on_start is not None:
                on_start([p.pid for p in procs if p.pid is not None])  # (every one: all have started)
            deadline = None if timeout is None else time.monotonic() + timeout
            _join_all(procs, out_dir, deadline, steps)
        except WorkerError as exc:
            _log(log_path, exc)
            raise
        finally:
            stopped = {r for r, p in enumerate(procs) if p.is_alive()}  # (peers of a failed worker)
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
        try:
            return _collect(procs, out_dir, steps, stopped, strict_exit)
        except WorkerError as exc:
            _log(log_path, exc)
            raise


#: How run_local starts its workers: "spawn" (the default: a fresh interpreter each, which
#: imports torch, 3 to 4 s of CPU on a small machine), or "forkserver" (forked from one
#: server process that imported torch and edgc once; each worker gets the launcher's
#: environment and working folder as they are when it starts). The test suite uses the
#: fork server; set EDGC_START_METHOD=forkserver to use it for `edgc train` too.
START_METHOD_ENV = "EDGC_START_METHOD"


def _start_context() -> tuple[Any, bool]:
    """The multiprocessing context of START_METHOD_ENV, and whether it forks from a server."""
    method = os.environ.get(START_METHOD_ENV, "spawn") or "spawn"
    if method not in ("spawn", "forkserver"):
        raise ValueError(f"{START_METHOD_ENV}={method!r}: use spawn or forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed", "edgc.train.trainer"])
    return ctx, method == "forkserver"


def _log(log_path: str | Path | None, exc: WorkerError) -> None:
    if log_path is None:
        return
    with open(log_path, "a") as f:
        f.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {exc}\n{exc.details}\n")


def _join_all(procs: list, out_dir: str, deadline: float | None, steps: Any) -> None:
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
            raise WorkerError(f"workers {alive} did not finish in time (hang or deadlock; at steps "
                              f"{[steps[r] for r in alive]}); all were killed", how="timeout",
                              rank=alive[0] if alive else None, step=max(steps) or None)
        time.sleep(0.05)


def _collect(procs: list, out_dir: str, steps: Any, stopped: set[int], strict_exit: bool = False) -> list[Any]:
    """Every worker's result by rank, or WorkerError naming the worker that failed first.

    A worker that dies takes its peers down with "Connection closed by peer" errors (or
    leaves them waiting); the root cause is a worker that died without reporting, or one
    whose error is not a peer's connection failure; the workers in `stopped` were killed
    here after another failed.
    """
    results, failures = [], []
    for r, p in enumerate(procs):
        path = os.path.join(out_dir, f"{r}.pkl")
        at = f" at step {steps[r]}" if steps[r] else ""
        if not os.path.exists(path):
            code = p.exitcode
            if code is not None and code < 0:
                how, what = "signal", f"was killed by {_signal_name(-code)}{at}"
            else:
                how, what = "exit", f"exited with code {code}{at} without a result"
            # a worker killed from outside (SIGKILL, SIGTERM: the OOM killer, a user) is the
            # cause, ahead of a peer's own error, whose wording varies with where it stood
            rank_first = -1 if code is not None and -code in _OUTSIDE_SIGNALS else 0
            failures.append((2 if r in stopped else rank_first, r, how, f"worker {r} {what}", None, ""))
            continue
        with open(path, "rb") as f:
            status, value, line = pickle.load(f)
        if status != "ok":
            peer = any(s in value for s in _PEER_FAILURES)
            failures.append((1 if peer else 0, r, "error", f"worker {r} failed{at}: {line}", line.split(":")[0], value))
        elif strict_exit and p.exitcode != 0:
            how, what = (("signal", f"was killed by {_signal_name(-p.exitcode)}") if p.exitcode < 0
                         else ("exit", f"exited with code {p.exitcode}"))
            failures.append((0, r, how, f"worker {r} reported its result, then {what} at exit", None, ""))
        results.append(value)
    if failures:
        failures.sort(key=lambda f: (f[0], f[1]))
        _, rank, how, message, cause, _ = failures[0]
        details = "\n".join(f"--- {m}\n{tb}" for _, _, _, m, _, tb in failures)
        return_step = steps[rank] or None
        raise WorkerError(message, details, rank=rank, step=return_step, how=how, cause=cause)
    return results


# what a worker reports when a peer died under it (gloo), not a cause of its own
_PEER_FAILURES = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket Timeout",
                  "NCCL communicator was aborted")


# signals that only come from outside a worker
_OUTSIDE_SIGNALS = (signal.SIGKILL, signal.SIGTERM)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
