"""`python -m ako` and the `ako` console script (`console`).

This module is light on purpose: a launched worker process imports the script it was started
from again (as multiprocessing does), so nothing here may act on import, and `ako train`
starts the workers' fork server before loading torch and ako (`ako.cli`), so that the server
loads them while the command does."""

import os
import sys


def console():
    """Run the command line of `sys.argv` and exit with its status (`ako.cli.console`)."""
    if sys.argv[1:2] == ["train"] and "TORCHELASTIC_RUN_ID" not in os.environ:
        from ako.runtime.distributed import forkserver

        forkserver.start()
    from ako import cli

    cli.console()


if __name__ == "__main__":
    console()
