"""A process that runs a sweep's `ako simulate` cells one after another, in itself.

A cell in a fresh process first spends about 4 s importing torch and torch._dynamo (which
torch.optim's first step imports): a third of a small cell. One process per job slot pays
that once. Each cell is still a whole `ako` command line, its output (file descriptors 1 and
2) in its own log, its randomness seeded by its own settings; a cell gives the same result
here as in a fresh process (tests/test_sweep.py).

The process is `python -m ako serve-cells FD` (`ako.__main__`, the top of the import graph):
it hands `serve` the command line's `main`, so this module never imports `ako.cli`, which
imports it (docs/design.md, "Layout").

Protocol: one JSON request a line on stdin, {"argv": [...], "log": path}; one JSON reply a
line on the file descriptor FD, {"status": exit status}. End of stdin ends the process.
`CellProcess` is the sweep's side.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import traceback
from contextlib import contextmanager
from collections.abc import Callable
from pathlib import Path

SERVE = "serve-cells"  # `python -m ako serve-cells FD` runs `serve` (ako/__main__.py)
Main = Callable[[list[str]], int]  # the command line's entry: argv -> exit status (`ako.cli.main`)


def run_cell_here(main: Main, argv: list[str], log: str) -> int:
    """`main(argv)` (`ako <argv>`) in this process with its stdout and stderr (the file
    descriptors, so torch's C++ output too) in `log`; returns its exit status. What a cell may
    change of the process is put back after it (`_process_state`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "w") as out, _process_state():
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        try:
            return main(argv)
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                return e.code or 0
            print(e.code, file=sys.stderr)  # sys.exit("message"), as Python prints it
            return 1
        except KeyboardInterrupt:
            raise
        except BaseException:  # a bug, not bad input: its traceback goes to the cell's log
            traceback.print_exc()
            return 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


@contextmanager
def _process_state():
    """Put back after a cell what it may change of the process and a fresh process would not
    carry into the next cell: the working directory, the warnings shown once, and torch's
    default dtype, thread count, deterministic and anomaly modes. (A user's own module-level
    state, and threads a cell leaves running, stay: docs/experiments.md.)"""
    import warnings

    import torch

    cwd, dtype, threads = os.getcwd(), torch.get_default_dtype(), torch.get_num_threads()
    deterministic, anomaly = torch.are_deterministic_algorithms_enabled(), torch.is_anomaly_enabled()
    try:
        with warnings.catch_warnings():
            yield
    finally:
        os.chdir(cwd)
        torch.set_default_dtype(dtype)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        torch.set_anomaly_enabled(anomaly)


def serve(reply_fd: int, main: Main) -> None:
    """Run the cells requested on stdin with `main` until it ends."""
    with os.fdopen(reply_fd, "w") as replies:
        for line in sys.stdin:
            request = json.loads(line)
            status = run_cell_here(main, request["argv"], request["log"])
            replies.write(json.dumps({"status": status}) + "\n")
            replies.flush()


class CellProcess:
    """The sweep's side: a `serve` process started on first use (with `env`), given one cell
    at a time; a new one after it dies or is stopped."""

    def __init__(self, env: dict | None):
        self.env = env
        self.process: subprocess.Popen | None = None
        self.replies = None

    def run(self, argv: list[str], log: Path, stop: threading.Event) -> int:
        """Run `ako <argv>` (output in `log`); its exit status, 130 when `stop` was set
        meanwhile (the process is then stopped), or the process's own status (negative: a
        signal) when it died in the cell."""
        if self.process is not None and self.process.poll() is not None:
            self.close()  # it died between cells (killed, out of memory): a new one
        if self.process is None:
            self._start()
        request = json.dumps({"argv": argv, "log": str(log)}) + "\n"
        try:
            self._send(request)
        except BrokenPipeError:  # it died just now: once more, in a new one
            self.close()
            self._start()
            self._send(request)
        while True:
            if stop.is_set():
                self.close(kill=True)
                return 130
            ready, _, _ = select.select([self.replies], [], [], 0.2)
            if ready:
                line = self.replies.readline()
                if line:
                    return int(json.loads(line)["status"])
                status = self.process.wait()  # died in the cell: its log has what it wrote
                self.close(kill=True)
                return status or 1

    def _send(self, request: str) -> None:
        self.process.stdin.write(request)
        self.process.stdin.flush()

    def _start(self) -> None:
        read, write = os.pipe()
        command = [sys.executable, "-m", "ako", SERVE, str(write)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, text=True, env=self.env, pass_fds=(write,))
        os.close(write)
        self.replies = os.fdopen(read)

    def close(self, kill: bool = False) -> None:
        """End the process: at once with `kill` (SIGTERM, SIGKILL after 10 s), else when it has
        read the end of its input."""
        if self.process is None:
            return
        process, self.process = self.process, None
        try:
            process.stdin.close()
        except OSError:  # BrokenPipeError: it is dead
            pass
        end_process(process, terminate=kill)
        self.replies.close()


def end_process(process: subprocess.Popen, terminate: bool) -> None:
    """Wait for `process` to end, first sending SIGTERM when `terminate`; SIGKILL after 10 s."""
    if terminate:
        process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
