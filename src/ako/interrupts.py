"""Ctrl-C and SIGTERM held off code that must not be interrupted half-way: imports.

Raised half-way through an import, KeyboardInterrupt gave a traceback, left a module half-made,
or was swallowed by C code it passed through, and the run went on as if no key was pressed
(torch._dynamo's import lost 1 Ctrl-C in 30 here); SIGTERM killed the process without a word.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def held(deliver: bool = True) -> Iterator[list[int]]:
    """In this block SIGINT and SIGTERM are noted, in the list it yields, and not acted on;
    after it, with `deliver`, they are raised again, in order, for the handlers of before
    (Ctrl-C's KeyboardInterrupt ends that; where one is ignored, nothing happens). Main
    thread only (only it may set handlers); elsewhere a no-op."""
    noted: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield noted
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    previous = {sig: handler for sig, handler in previous.items() if handler is not None}  # None: set outside Python
    for sig in previous:
        signal.signal(sig, lambda signum, frame: noted.append(signum))
    try:
        yield noted
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if deliver:
        for sig in dict.fromkeys(noted):
            signal.raise_signal(sig)
