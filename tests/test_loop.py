"""Your own training loop (ako.wrap, ako.finish, ako run): the same strategy programs driven by
the user's optimizer.step() give what `ako train` gives; failures and bad usage are one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ako
from ako import TrainConfig

sys.path.insert(0, str(Path(__file__).parent))
import loop_script  # noqa: E402

SCRIPT = str(Path(__file__).parent / "loop_script.py")


def ako_run(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")}
    return subprocess.run([sys.executable, "-m", "ako", "run", *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=timeout)  # fmt: skip


def trained_by_ako_train(tmp_path: Path, strategy: str, **options) -> torch.Tensor:
    """`ako train` (the API) on the script's model, data, optimizer and seed: 2 workers, 6 steps."""
    config = TrainConfig(strategy=strategy, workers=2, batch_size=loop_script.BATCH, epochs=0.5, eval_every=10.0,
                         lr=loop_script.LR, momentum=loop_script.MOMENTUM, weight_decay=loop_script.WEIGHT_DECAY,
                         nesterov=True, timeout=30.0, out_dir=str(tmp_path / "train"), progress=False, **options)  # fmt: skip
    data = loop_script.digits_like()
    result = ako.train(config, model_fn=loop_script.mlp, train_set=data, test_set=data)
    return result.model


def test_the_shards_are_ako_trains():
    """384 samples, 2 workers, batches of 16: 12 steps an epoch, the first 6 used by both."""
    assert 384 // 2 // loop_script.BATCH == 12


def test_a_wrapped_loop_under_allreduce_equals_ako_train(tmp_path):
    expected = trained_by_ako_train(tmp_path, "allreduce")
    out = ako_run("--workers", "2", "--strategy", "allreduce", SCRIPT, str(tmp_path), "6", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()
    start = torch.cat([p.detach().reshape(-1) for p in (torch.manual_seed(0), loop_script.mlp())[1].parameters()])
    assert (expected - start).abs().max() > 1e-3  # it trained


def test_a_wrapped_loop_under_ako_at_one_partition_and_no_staleness_equals_allreduce(tmp_path):
    expected = trained_by_ako_train(tmp_path, "allreduce")
    out = ako_run("--workers", "2", "--strategy", "ako", "--partitions", "1", "--staleness", "0", SCRIPT, str(tmp_path),
                  "6", cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "partial steps behind a straggler are off" in out.stderr
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()


def test_under_ako_defaults_the_replicas_are_equal_after_finish_and_the_run_directory_has_the_metrics(tmp_path):
    out = ako_run("--workers", "2", "--strategy", "ako", "--record-every", "4", SCRIPT, str(tmp_path), "12", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    first, second = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert torch.allclose(first, second, atol=1e-6, rtol=0), (first - second).abs().max()
    (run_dir,) = (tmp_path / "runs").iterdir()
    import json

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps_per_worker"] == [12, 12] and summary["final_consensus_distance"] < 1e-6
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [4, 8, 12]
    assert all(r["replicas"] == 2 and r["consensus_distance"] >= 0 and r["bytes_sent"] > 0 for r in records)
    assert records[-1]["bytes_sent"] > records[0]["bytes_sent"]

