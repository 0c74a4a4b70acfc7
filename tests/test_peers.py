"""The torch-only peer arms of benchmarks/peers.py really train, so that a broken peer setup is
never reported as a slow peer: on 2 workers under torchrun, each arm's loss goes down and its
snapshots are evaluated."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("ddp", "powersgd-r1", "powersgd-r4", "post-local-sgd")


@pytest.mark.parametrize("arm", ARMS)
def test_each_torch_peer_arm_trains(tmp_path, arm):
    """The first 4,096 images of Fashion-MNIST (the CI installs it), 1 epoch: 32
    steps of batch 64 on each of 2 workers (PowerSGD compresses and local SGD averages from step
    3 on); the mean loss of the last 5 steps is below the first step's, the result names 32 steps
    and 2 workers, and rank 0's final snapshot is evaluated on the test set."""
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "benchmarks" / "peer_torch.py"), "--arm", arm, "--check", "--train-samples", "4096",
           "--test-samples", "500", "--epochs", "1", "--eval-every", "0.5", "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["steps"] == 32 and result["workers"] == 2
    assert result["last_loss"] < result["first_loss"] - 0.2
    assert [r["epoch"] for r in result["records"]] == [0.5, 1.0]
    assert 0.0 <= result["records"][-1]["loss"] and result["records"][-1]["accuracy"] > 0.2
    assert result["bytes_sent_per_worker_per_second"] > 0
