"""Gloo's own connection-retry lines are dropped from a process's stderr; everything else,
written by Python or straight to fd 2, comes through whole and in order, up to os._exit. A
launched process writes where its launcher's stdout and stderr go when it is launched."""

from __future__ import annotations

import os
import subprocess
import sys

from ako.runtime.distributed.launcher import launch_function

CHILD = r"""
import os, sys
from ako.runtime.distributed import quiet
quiet.drop_gloo_lines()
print("first", file=sys.stderr)
os.write(2, b"[/pytorch/third_party/gloo/gloo/transport/tcp/debug_logger.cc:9] ERROR failed to connect, willRetry=1\n")
os.write(2, b"second, from fd 2\n")
print("third " * 2000, file=sys.stderr)  # longer than a pipe's buffer holds at once
quiet.drain()
os._exit(0)
"""


def test_gloo_lines_are_dropped_and_the_rest_kept():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert proc.stderr == "first\nsecond, from fd 2\n" + "third " * 2000 + "\n"


BAR = r"""
import os, sys, time
from ako.runtime.distributed import quiet
terminal_before = os.isatty(2)
quiet.drop_gloo_lines()
print(terminal_before, quiet.on_terminal(), os.isatty(2), flush=True)
os.write(2, b"\r 50%|#####     |")  # a progress bar's redraw: no newline
time.sleep(0.5)
print("drawn", flush=True)  # the parent has read the redraw by now, or not
time.sleep(5)
quiet.drain()
os._exit(0)
"""


def test_a_bar_redraw_comes_through_at_once_and_a_terminal_stays_one_for_the_bar():
    """A progress bar redraws its line in place ("\\r..."): it is copied as it comes, not held
    until a newline; and `on_terminal` says whether stderr was a terminal before the filter
    made it a pipe (rank 0's bar is drawn by default on a terminal only)."""
    import os
    import pty
    import select

    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", BAR], stdout=subprocess.PIPE, stderr=follower, text=True)
    os.close(follower)
    try:
        assert proc.stdout.readline().split() == ["True", "True", "False"]
        assert proc.stdout.readline() == "drawn\n"
        ready, _, _ = select.select([leader], [], [], 2.0)
        assert ready and os.read(leader, 1024) == b"\r 50%|#####     |"
    finally:
        proc.kill()
        proc.wait()
        os.close(leader)


def say(word: str) -> str:
    """A launched process's part: one line on stdout, one on stderr; returns $AKO_WORD."""
    rank, said = os.environ["RANK"], os.environ.get("AKO_WORD")
    print(word, rank, said, flush=True)
    print(word, rank, "on stderr", file=sys.stderr, flush=True)
    return said


def test_a_launched_process_writes_where_its_launcher_does_and_has_its_environment(tmp_path, monkeypatch):
    """The processes are forked by a fork server started by the first launch, whose stdout,
    stderr and environment were the launcher's then: a later launch's processes still take
    the launcher's as they are at that launch."""
    launch_function(say, 1, "warm-up")
    monkeypatch.setenv("AKO_WORD", "now")
    saved = os.dup(1), os.dup(2)
    try:
        with open(tmp_path / "out", "wb") as out, open(tmp_path / "err", "wb") as err:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            results = launch_function(say, 2, "hello")
    finally:
        for fd, copy in enumerate(saved, start=1):
            os.dup2(copy, fd)
            os.close(copy)
    assert results == {0: "now", 1: "now"}
    assert sorted((tmp_path / "out").read_text().splitlines()) == ["hello 0 now", "hello 1 now"]
    assert sorted((tmp_path / "err").read_text().splitlines()) == ["hello 0 on stderr", "hello 1 on stderr"]
