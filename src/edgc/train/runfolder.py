"""A run folder's guards: one writer at a time, no silent overwrite, no leftovers.

- `RunLock` holds an exclusive `flock` on `<run>/.edgc.lock` for the whole run. The kernel
  drops it when the holder exits, however it dies, so a stale lock never blocks a resume.
  The lock file names the holder's pid and its workers' pids, for the user (and tests)
  who want to know what is running there.
- `check_new_run` refuses to start a new run over an old one's files unless asked to
  overwrite, and then removes only the files a run writes.
- `clean_leftovers` removes the temporary files of a checkpoint write that was killed.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

__all__ = ["LOCK_NAME", "RUN_FILES", "RunFolderBusy", "RunLock", "check_new_run", "clean_leftovers"]

LOCK_NAME = ".edgc.lock"

# what a run writes into its folder (globs); --overwrite removes exactly these
RUN_FILES = ("checkpoint.pt", "checkpoint-*.pt", "metrics.jsonl", "config.json", "summary.md", "dac.jsonl",
             "errors.log", "val_blocks.npz", "loss.png", "entropy.png", "rank.png", "bytes.png", "stages.png",
             "tensorboard/events.out.tfevents.*")


class RunFolderBusy(ValueError):
    """Another process is writing to this run folder."""


class RunLock:
    """An exclusive lock on a run folder, held from `acquire` until `release` (or exit).

    Creates the folder. Raises RunFolderBusy, naming the holder, if another process
    holds it.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self._fd: int | None = None

    def acquire(self, note: bool = True) -> RunLock:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            os.close(fd)
            raise RunFolderBusy(f"run folder {str(self.folder)!r} is in use by another edgc process "
                                f"({holder or 'pid unknown'}); wait for it to end or stop it, or choose "
                                f"another --out (two writers would corrupt its metrics and checkpoint)") from None
        self._fd = fd
        if note:
            self.note()
        return self

    @classmethod
    def check_free(cls, folder: str | Path) -> None:
        """Raise RunFolderBusy if another process holds the folder's lock; creates nothing."""
        lock = cls(folder)
        if lock.path.is_file():
            lock.acquire(note=False)
            lock.release()

    def note(self, workers: list[int] | None = None) -> None:
        """Record who holds the lock: this pid, its start time, and its workers' pids."""
        assert self._fd is not None
        text = f"pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
        if workers:
            text += ", workers " + " ".join(str(p) for p in workers)
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, (text + "\n").encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # (closing drops the flock; the file stays, unlocked)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire() if self._fd is None else self

    def __exit__(self, *exc: object) -> None:
        self.release()


def check_new_run(folder: str | Path, overwrite: bool) -> None:
    """Refuse to start a new run in a folder that holds another run's files, unless
    `overwrite`; then remove those files (and only those)."""
    folder = Path(folder)
    found = sorted({p for pattern in RUN_FILES for p in folder.glob(pattern)})
    if not found:
        return
    if not overwrite:
        has_ckpt = (folder / "checkpoint.pt").exists()
        raise ValueError(
            f"{str(folder)!r} already holds a run ({', '.join(p.name for p in found[:4])}"
            f"{', ...' if len(found) > 4 else ''}); "
            + (f"continue it with --resume {folder}, " if has_ckpt else "")
            + "choose another --out, or replace it with --overwrite")
    for p in found:
        p.unlink()


def clean_leftovers(folder: str | Path) -> list[Path]:
    """Remove temporary files left by a process killed while writing a checkpoint or
    another file atomically (`.NAME.XXXX.tmp`, see edgc.atomic); returns them.
    Call it holding the folder's lock, so no live writer's file is removed."""
    removed = []
    for p in Path(folder).glob(".*.tmp"):
        if p.is_file():
            p.unlink()
            removed.append(p)
    return removed
