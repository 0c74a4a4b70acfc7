"""The multi-host test bed (`scripts/netcluster`): 2 hosts as network namespaces on a bridge,
links limited to 10 Mbit/s each way with 2 ms of added delay, `torchrun` with the c10d
rendezvous on each. The limit is real: every all-reduce step must move its bytes through it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[1] / "scripts" / "netcluster"


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root for network namespaces and tc (CI machines have it)"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` does not work on this machine"
    return None


@pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")
def test_two_hosts_over_a_limited_delayed_link(tmp_path):
    rate = 10e6 / 8  # bytes/s
    stats = tmp_path / "stats.json"
    cmd = [sys.executable, str(SCRIPT), "--hosts", "2", "--rate", "10mbit", "--delay", "2ms", "--timeout", "240",
           "--stats", str(stats), "--",
           "--strategy", "allreduce", "--dataset", "digits", "--batch-size", "32", "--epochs", "2",
           "--eval-every", "1", "--out-dir", str(tmp_path), "--no-progress"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    summary = json.loads(next(tmp_path.glob("*/summary.json")).read_text())
    assert summary["workers"] == 2 and summary["test_accuracy"] > 0.3
    # each step's ring all-reduce sends 2 (n-1)/n x 22 602 x 4 bytes (+ the stop vote) each way
    step_bytes = (22_602 + 1) * 4
    assert summary["bytes_sent_per_worker_per_second"] <= rate
    assert summary["train_seconds"] >= summary["iterations"] * step_bytes / rate
    # every host's eth0 carried at least the payload it sent (plus headers and the rendezvous)
    sent = summary["bytes_sent_per_worker_per_second"] * summary["train_seconds"]
    hosts = json.loads(stats.read_text())
    assert sorted(hosts) == ["1", "2"] and all(h["tx"]["bytes"] >= sent and h["rx"]["bytes"] >= sent for h in hosts.values())
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "ako-" not in namespaces  # removed afterwards


@pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")
def test_a_wrapped_loop_across_two_hosts_honours_the_link(tmp_path):
    """examples/nanogpt's own loop (ako.wrap) under torchrun on 2 hosts at 10 Mbit/s, its
    strategy (allreduce) and run directory given as `ako run` gives them (AKO_LOOP): each step's
    ring all-reduce of the gpt's gradient moves through the limited links."""
    rate = 10e6 / 8  # bytes/s
    stats = tmp_path / "stats.json"
    loop = json.dumps({"strategy": "allreduce", "out_dir": str(tmp_path / "runs"), "record_every": 5})
    script = Path(__file__).parents[1] / "examples" / "nanogpt" / "train.py"
    cmd = [sys.executable, str(SCRIPT), "--hosts", "2", "--rate", "10mbit", "--timeout", "240", "--stats", str(stats),
           "--script", str(script), "--",
           "--max-iters", "12", "--grad-accum", "1", "--batch-size", "4", "--context", "32", "--layers", "1",
           "--width", "32", "--eval-interval", "100", "--eval-iters", "1", "--out", str(tmp_path / "ckpt.pt")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "AKO_LOOP": loop})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and (tmp_path / "ckpt.pt").exists()
    summary = json.loads(next((tmp_path / "runs").glob("*/summary.json")).read_text())
    assert summary["strategy"] == "allreduce" and summary["steps_per_worker"] == [12, 12]
    numel = sum(p.numel() for p in torch.load(tmp_path / "ckpt.pt", weights_only=True)["model"].values())
    assert summary["bytes_sent_per_worker_per_second"] <= rate
    assert summary["train_seconds"] >= 12 * numel * 4 / rate  # ring: 2 (n-1)/n = 1 gradient a step each way
    sent = summary["bytes_sent_per_worker_per_second"] * summary["train_seconds"]
    hosts = json.loads(stats.read_text())
    assert all(h["tx"]["bytes"] >= sent >= 12 * numel * 4 for h in hosts.values())
