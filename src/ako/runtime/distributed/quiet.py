"""Gloo's own log lines kept off a process's stderr.

Gloo writes some messages straight to file descriptor 2, past TORCH_CPP_LOG_LEVEL: one line
per retry of a failed connection ("debug_logger.cc ... failed to connect, willRetry=..."), a
dozen of them when a peer is gone during start-up. ako reports that failure itself in one
line, so these are dropped: fd 2 becomes a pipe, and a thread copies every other line to the
real stderr (and a progress bar's redraws as they come).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

NOISE = (b"gloo/transport/tcp/debug_logger.cc",)  # what no user needs to read
_drain = None
_terminal: bool | None = None  # whether fd 2 was a terminal before it became the pipe


def on_terminal() -> bool:
    """Whether this process's stderr is a terminal (the real one, while it is filtered): where
    a progress bar is drawn by default."""
    return _terminal if _drain is not None else os.isatty(2)


def drop_gloo_lines() -> None:
    """Filter this process's stderr (fd 2) from now on; `drain` (also run at exit) ends it."""
    global _drain, _terminal
    if _drain is not None:
        return
    sys.stderr.flush()
    _terminal = os.isatty(2)
    real = os.dup(2)
    read, write = os.pipe()
    os.dup2(write, 2)
    os.close(write)

    def pump():
        pending = b""
        while chunk := os.read(read, 1 << 16):
            pending = _forward(real, pending + chunk)
        if pending and not any(n in pending for n in NOISE):
            os.write(real, pending)  # the last line, unended
        os.close(read)

    thread = threading.Thread(target=pump, name="ako-stderr", daemon=True)
    thread.start()

    def finish():
        sys.stderr.flush()
        os.dup2(real, 2)  # closes the pipe's only write end: the thread reads to its end
        thread.join(1.0)

    _drain = finish
    atexit.register(drain)


def _forward(fd: int, text: bytes) -> bytes:
    """Write `text`'s whole lines but Gloo's to `fd`, and a progress bar's redraws in place
    (a line begun with a carriage return) at once, not when its line ends; returns the rest."""
    *lines, rest = text.split(b"\n")
    out = b"".join(line + b"\n" for line in lines if not any(n in line for n in NOISE))
    if b"\r" in rest:
        out, rest = out + rest, b""
    if out:
        os.write(fd, out)
    return rest


def drain() -> None:
    """Copy what is left in the pipe and give fd 2 back (before os._exit, which skips atexit)."""
    global _drain
    finish, _drain = _drain, None
    sys.stderr.flush()
    if finish is not None:
        finish()
