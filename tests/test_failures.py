"""A worker or server killed mid-run: a synchronous job ends quickly, naming the rank; an
asynchronous one carries on without the worker and reports it."""

from __future__ import annotations

import json
import sys

import pytest
from helpers import run_and_kill


def start_and_kill(tmp_path, strategy: str, victim_name: str, *extra: str):
    """Start a 2-worker run, kill the process named `victim_name` once training has begun;
    returns (exit status, stderr, stdout, seconds from the kill to the end)."""
    out_dir = tmp_path / "runs"
    cmd = [sys.executable, "-m", "ako", "train", "--strategy", strategy, "--workers", "2",
           "--dataset", "digits", "--epochs", "100000", "--eval-every", "1000",
           "--target-accuracy", "0.999",  # evaluates online: metrics show training has begun
           "--out-dir", str(out_dir), "--timeout", "60", *extra]  # fmt: skip
    code, out, err, elapsed = run_and_kill(cmd, victim_name, out_dir, settle=1.0)
    return code, err, out, elapsed


# The launcher ends every job whose strategy does not survive losses the same way; one
# strategy of each kind (collective, peer to peer, parameter server) keeps CI short.
@pytest.mark.parametrize("strategy", ["allreduce", "ako", "bsp"])
def test_killed_worker_stops_a_synchronous_job_within_20_s_naming_its_rank(tmp_path, strategy):
    code, err, _, elapsed = start_and_kill(tmp_path, strategy, "ako-rank1")
    assert code == 1, err
    assert elapsed < 20, f"took {elapsed:.1f} s"
    assert "worker rank 1 failed: killed by SIGKILL" in err, err
    assert "Traceback" not in err, err


@pytest.mark.parametrize("strategy", ["asp", "easgd"])
def test_asynchronous_job_survives_a_killed_worker_and_reports_it(tmp_path, strategy):
    code, err, out, elapsed = start_and_kill(tmp_path, strategy, "ako-rank1", "--max-time", "6")
    assert code == 0, err
    assert "worker rank 1 died; the others carried on" in out, out
    summary = json.loads(next((tmp_path / "runs").glob("*/summary.json")).read_text())
    assert summary["lost_ranks"] == [1]
    assert [w["rank"] for w in summary["per_worker"]] == [0]
    assert summary["train_seconds"] >= 6
    assert "Traceback" not in err, err


@pytest.mark.parametrize("strategy", ["asp"])  # even a strategy that survives worker losses
def test_killed_server_stops_the_job_naming_it(tmp_path, strategy):
    code, err, _, elapsed = start_and_kill(tmp_path, strategy, "ako-server2")
    assert code == 1, err
    assert elapsed < 20, f"took {elapsed:.1f} s"
    assert "server rank 2 failed: killed by SIGKILL" in err, err
    assert "Traceback" not in err, err
