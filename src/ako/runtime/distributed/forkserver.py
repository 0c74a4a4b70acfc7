"""Where the launcher's processes come from: a fork server that has loaded torch and ako once
(`preload`), so that each process starts in milliseconds instead of importing them itself
(2.8 s of CPU a process here: torch, and torch._dynamo, which torch.optim loads). Measured on
2 cores: a 2-worker `ako train` of 0.1 epochs 6.4 s -> 3.9 s from the command line; each
further 2-worker run in one Python process (a sweep cell, a resume, a test) 2.8 s -> 0.2 s.
This module imports neither torch nor ako, so that `ako train` can start the server first
and the server loads while the command loads and checks its input."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from multiprocessing import forkserver

PRELOAD = ["ako.runtime.distributed.preload"]
_QUIET = (signal.SIGINT, signal.SIGTERM)


def context():
    """The multiprocessing context to start launched processes with: the fork server, where
    the platform has one (Linux, macOS); else spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def start() -> None:
    """Start the fork server now, in the background (it loads `PRELOAD`); a no-op where there
    is none, or when it is running. It starts with Ctrl-C and SIGTERM ignored (a new program
    inherits that): a signal to the process group while it loads must not end it with a
    traceback. (A Ctrl-C in the millisecond this takes is lost.)"""
    if context().get_start_method() != "forkserver":
        return
    main = threading.current_thread() is threading.main_thread()  # only it may set handlers
    previous = [signal.signal(s, signal.SIG_IGN) for s in _QUIET] if main else []
    try:
        forkserver.ensure_running()
    finally:
        for s, handler in zip(_QUIET, previous):
            signal.signal(s, handler)


def stop() -> None:
    """End the fork server this process started, if it runs (`ako train`'s last step: the
    command is over). A server still loading torch would keep the command's stdout and stderr
    open for seconds after it exits, and a reader of them (`ako train ... | tee log`, a test's
    pipe) would wait that long for their end: 2.5 s after a one-line error here. Its launched
    processes, if any are left, die with their launcher, not with it."""
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
