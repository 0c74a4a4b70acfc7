"""Checkpoint files: written atomically, read with weights_only=True, and a checkpoint that
cannot be read or does not fit the run is refused with one line (exit status 2) before any
process starts."""

from __future__ import annotations

import pytest
import torch
from helpers import small_config

from ako.cli import main
from ako.config import to_toml
from ako.runtime.distributed import checkpoint
from ako.run.job import Job


class Payload:
    """Not a tensor, number, string, list or dict: weights_only=True refuses to unpickle it."""


# the parts of a worker's and a server's state a checkpoint must have (their values do not matter here)
WORKER_STATE = {"role": "worker", "params": torch.zeros(1), "optimizer": {}, "worker": {}, "bytes": [0, 0]}
SERVER_STATE = {"role": "server", "shard": {}, "bytes": [0, 0]}


def checkpointed_run(tmp_path, servers: int = 0, **overrides):
    """A run directory as `ako train --checkpoint-every` leaves it: its config and a complete
    checkpoint at step 7 that fits it (2 workers, then `servers` servers)."""
    config = small_config(tmp_path, checkpoint_every="1s", servers=servers or None, **overrides)
    job = Job(config)
    numel = job.build_replica(job.load_data(), torch.device("cpu")).numel
    path = tmp_path / "runs" / "run"
    path.mkdir(parents=True)
    (path / "config.toml").write_text(to_toml(config))
    for rank in range(2 + servers):
        checkpoint.save(path, 7, rank, 2 + servers, {**job.identity(numel), **(WORKER_STATE if rank < 2 else SERVER_STATE)})
    return path


@pytest.fixture
def run_dir(tmp_path):
    return checkpointed_run(tmp_path, strategy="allreduce")


def resume(run_dir, capsys, *flags):
    code = main(["train", "--resume", str(run_dir), *flags])
    return code, capsys.readouterr().err


def test_a_fitting_checkpoint_is_found(run_dir):
    assert checkpoint.latest(run_dir, 2) == 7
    assert checkpoint.load(run_dir, 7, 1)["rank"] == 1
    assert [p.name for p in run_dir.rglob("*") if p.name.startswith(".")] == []  # no temporary files


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--workers", "3"], "written by a run with world 2, not 3"),
        (["--model", "mlp"], "written by a run with model 'cnn', not 'mlp'"),
        (["--strategy", "gossip"], "written by a run with strategy 'allreduce', not 'gossip'"),
    ],
)
def test_a_checkpoint_of_another_run_is_refused(run_dir, capsys, flags, message):
    code, err = resume(run_dir, capsys, *flags)
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_a_corrupt_checkpoint_is_refused(run_dir, capsys):
    checkpoint.path(run_dir, 7, 0).write_bytes(b"not a checkpoint")
    code, err = resume(run_dir, capsys)
    assert code == 2 and err.count("\n") == 1 and "rank0.pt': cannot read it" in err, err


def test_a_corrupt_file_of_any_rank_is_refused_before_anything_starts(run_dir, capsys):
    checkpoint.path(run_dir, 7, 1).write_bytes(b"not a checkpoint")
    before = (run_dir / "config.toml").read_text()
    code, err = resume(run_dir, capsys)
    assert code == 2 and err.count("\n") == 1 and "rank1.pt': cannot read it" in err, err
    assert (run_dir / "config.toml").read_text() == before


def test_another_worker_server_split_is_refused(tmp_path, capsys):
    """bsp with 2 workers and 1 server, resumed as 1 worker and 2 servers: the same world size."""
    run_dir = checkpointed_run(tmp_path, servers=1, strategy="bsp")
    code, err = resume(run_dir, capsys, "--workers", "1", "--servers", "2")
    assert code == 2 and err.count("\n") == 1, err
    assert "rank1.pt': written by a run with role 'worker', not 'server'" in err, err


def test_a_checkpoint_that_would_run_code_is_refused(run_dir, capsys):
    torch.save({"format": checkpoint.FORMAT, "payload": Payload()}, checkpoint.path(run_dir, 7, 0))
    code, err = resume(run_dir, capsys)
    assert code == 2 and err.count("\n") == 1 and "cannot read it (Weights only load failed" in err, err


def test_an_incomplete_checkpoint_is_not_resumed(run_dir, capsys):
    checkpoint.path(run_dir, 7, 1).unlink()
    code, err = resume(run_dir, capsys)
    assert code == 2 and err.count("\n") == 1 and "no complete checkpoint in it" in err, err


def test_a_failed_write_leaves_no_file(tmp_path):
    with pytest.raises(Exception):
        checkpoint.save(tmp_path, 3, 0, 1, {"unpicklable": lambda: None})
    assert list(tmp_path.rglob("*.pt")) == [] and list(tmp_path.rglob(".*")) == []


def test_each_rank_keeps_two_files_and_the_latest_complete_checkpoint(tmp_path):
    checkpoint.save(tmp_path, 1, 1, 2, {})
    checkpoint.save(tmp_path, 1, 0, 2, {})  # step 1 is complete
    for point in (2, 3, 4):  # rank 1 is gone: later checkpoints stay incomplete
        checkpoint.save(tmp_path, point, 0, 2, {})
    kept = sorted(str(p.relative_to(tmp_path / "checkpoints")) for p in tmp_path.rglob("*.pt"))
    assert kept == ["000000001/rank0.pt", "000000001/rank1.pt", "000000003/rank0.pt", "000000004/rank0.pt"]
    assert checkpoint.latest(tmp_path, 2) == 1


class _Rank:
    """What `checkpoint.Checkpoints` reads of a runtime: the worker state (None on a server)."""

    def __init__(self, state):
        self.state = state


class _State:
    checkpoint_at = None


@pytest.mark.parametrize("role", ["worker", "server"])
def test_a_pending_call_for_a_checkpoint_is_kept_over_a_newer_one(role):
    # A rank that lags rank 0 meets the next call before the step it was called for: it must
    # still save at that step, or under asp it may never save a complete checkpoint.
    state = _State() if role == "worker" else None
    calls = checkpoint.Checkpoints(_Rank(state), None, 0.2, {})
    calls.called(40)
    calls.called(85)
    assert (state.checkpoint_at if state else calls.due) == 40
    if state:
        state.checkpoint_at = None  # saved at step 40
    else:
        calls.due = None
    calls.called(130)
    assert (state.checkpoint_at if state else calls.due) == 130


def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, capsys):
    """Steps 7 and 9 complete; step 9's rank 1 file damaged: the resume takes step 7 and
    says why in one whole line."""
    run_dir = checkpointed_run(tmp_path, strategy="allreduce")
    job = Job(small_config(tmp_path, checkpoint_every="1s", strategy="allreduce"))
    identity = job.identity(job.build_replica(job.load_data(), torch.device("cpu")).numel)
    for rank in range(2):
        checkpoint.save(run_dir, 9, rank, 2, {**identity, **WORKER_STATE})
    checkpoint.path(run_dir, 9, 1).write_bytes(b"cut off")
    assert checkpoint.find(run_dir, identity, 2, say=True) == 7
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "000000009/rank1.pt': cannot read it" in err
    assert err.rstrip().endswith("resuming from the intact checkpoint at step 7 instead of step 9")
    checkpoint.path(run_dir, 7, 0).write_bytes(b"cut off too")
    with pytest.raises(checkpoint.CheckpointError, match="no intact complete checkpoint; the newest: checkpoint .*000000009"):
        checkpoint.find(run_dir, identity, 2)
