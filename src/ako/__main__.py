"""`python -m ako` and the `ako` console script (`console`).

This module is light on purpose: a launched worker process imports the script it was started
from again (as multiprocessing does), so nothing here may act on import, and `ako train`
starts the workers' fork server before loading torch and ako (`ako.cli`), so that the server
loads them while the command does."""

import atexit
import os
import sys

_status = 1  # the exit status, once known (a traceback leaves it 1)


def console():
    """Run the command line of `sys.argv` and exit with its status (`ako.cli.console`)."""
    global _status
    atexit.register(_skip_teardown)  # first: it runs after every exit handler registered later
    if sys.argv[1:2] == ["train"] and "TORCHELASTIC_RUN_ID" not in os.environ:
        from ako.runtime.distributed import forkserver

        forkserver.start()
        atexit.register(forkserver.stop)  # runs before `_skip_teardown`
    from ako import cli

    try:
        cli.console()
    except SystemExit as done:
        _status = done.code if isinstance(done.code, int) else 0 if done.code is None else 1
        raise


def _skip_teardown() -> None:
    """The last exit handler: end the process now. What is left of Python's exit with torch
    loaded, its modules' teardown, took 1.1 s, with nothing to do for a command that is over."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # the reader left, the stream is closed, or None
            pass
    os._exit(_status)


def serve_cells(reply_fd: int) -> None:
    """A sweep's long-lived process for simulated cells (`ako.experiments.cell_process`),
    each cell a whole `ako` command line run by `ako.cli.main`."""
    from ako.cli import main
    from ako.experiments.cell_process import serve

    try:
        serve(reply_fd, main)
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: the sweep says it
        pass


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve-cells"]:  # `cell_process.SERVE`, not imported here: this module stays light
        serve_cells(int(sys.argv[2]))
    else:
        console()
