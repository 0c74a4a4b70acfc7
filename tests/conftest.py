"""pytest's set-up for ako's tests."""

import os


def pytest_configure(config):
    """Under pytest-xdist (`make test` runs two test processes at once) each test process
    leads a session of its own, so that a test's look for processes it left behind
    (`helpers.session`) sees its own, not the other test process's."""
    if os.environ.get("PYTEST_XDIST_WORKER") and os.getsid(0) != os.getpid():
        try:
            os.setsid()
        except PermissionError:  # already a process group leader: it keeps the shared session
            pass
