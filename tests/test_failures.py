"""A worker killed mid-run ends the whole job quickly, with a message naming its rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def find_worker(rank: int, deadline: float) -> int:
    """PID of the process named ako-rank<rank> (workers name themselves), waiting for it."""
    while time.monotonic() < deadline:
        for comm in Path("/proc").glob("[0-9]*/comm"):
            try:
                if comm.read_text().strip() == f"ako-rank{rank}":
                    return int(comm.parent.name)
            except OSError:
                continue
        time.sleep(0.1)
    raise AssertionError(f"no process ako-rank{rank} appeared")


def wait_for_metrics(out_dir: Path, deadline: float) -> None:
    """Until rank 0 has logged its first evaluation: training has started."""
    while time.monotonic() < deadline:
        if any(p.stat().st_size > 0 for p in out_dir.glob("*/metrics.jsonl")):
            return
        time.sleep(0.1)
    raise AssertionError("training did not start")


@pytest.mark.parametrize("strategy", ["allreduce", "ako"])
def test_killed_worker_stops_the_job_within_20_s_naming_its_rank(tmp_path, strategy):
    out_dir = tmp_path / "runs"
    cmd = [sys.executable, "-m", "ako", "train", "--strategy", strategy, "--workers", "2",
           "--dataset", "digits", "--epochs", "100000", "--eval-every", "1000",
           "--target-accuracy", "0.999",  # evaluates online: metrics show training has begun
           "--out-dir", str(out_dir), "--timeout", "60"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        victim = find_worker(1, deadline)
        wait_for_metrics(out_dir, deadline)
        time.sleep(1.0)
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
        elapsed = time.monotonic() - killed
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 1, err
    assert elapsed < 20, f"took {elapsed:.1f} s"
    assert "worker rank 1 failed: killed by SIGKILL" in err, err
    assert "Traceback" not in err, err
