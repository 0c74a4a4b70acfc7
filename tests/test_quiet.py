"""Gloo's own connection-retry lines are dropped from a process's stderr; everything else,
written by Python or straight to fd 2, comes through whole and in order, up to os._exit."""

from __future__ import annotations

import subprocess
import sys

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
