"""One writer per run directory: the process that writes a run (rank 0) holds an exclusive
`flock` on the directory itself for as long as it runs. The kernel drops the lock when the
process ends, however it ends (kill -9 included), so a stale lock never blocks a resume, and
no lock file is left behind."""

from __future__ import annotations

import fcntl
import os

from ako.config import ConfigError

_held: dict[str, int] = {}  # run directory -> the descriptor holding its lock, in this process


class RunDirBusy(ConfigError):
    """Another process holds the run directory's lock: it is writing that run now."""


def hold(run_dir: str | os.PathLike) -> None:
    """Take `run_dir`'s lock for this process (until `release_all`). Raises RunDirBusy when
    another process holds it. A file system without flock (some network ones) is not locked."""
    key = os.path.abspath(run_dir)
    if key in _held:
        return
    fd = os.open(key, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunDirBusy(f"resume {str(run_dir)!r}: another ako process is training into it now (it holds the run "
                         "directory's lock); wait for it to end, or stop it first") from None  # fmt: skip
    except OSError:  # no flock here (ENOLCK, EINVAL): unlocked, as before
        os.close(fd)
        return
    _held[key] = fd


def check_free(run_dir: str | os.PathLike) -> None:
    """Raise RunDirBusy when another process holds `run_dir`'s lock (before a resume starts
    any process); the lock is not kept."""
    if os.path.isdir(run_dir) and os.path.abspath(run_dir) not in _held:
        hold(run_dir)
        release(run_dir)


def release(run_dir: str | os.PathLike) -> None:
    fd = _held.pop(os.path.abspath(run_dir), None)
    if fd is not None:
        os.close(fd)  # closing the only descriptor of the open file drops the flock


def release_all() -> None:
    """Drop every lock this process holds (its run has ended)."""
    for run_dir in list(_held):
        release(run_dir)
