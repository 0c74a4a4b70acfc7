"""A full disk loses nothing it need not: the run's files are written whole or not at all (no
temporary file keeps the disk full), a checkpoint that cannot be written is skipped with one
line, the summary is written first at the end, and what could not be saved is said in one
line naming the file and the reason. Each test mounts a small tmpfs (root only)."""

from __future__ import annotations

import json
import math
import os
import subprocess

import pytest
import torch
from helpers import small_config

from ako.cli import main
from ako.metrics import MetricsLog, WriteFailed, write_atomic
from ako.run.job import Job
from ako.runtime.distributed import checkpoint

PAGE = 4096  # tmpfs counts its room in pages


@pytest.fixture
def disk(tmp_path):
    """A 1 MiB tmpfs at tmp_path/disk, unmounted afterwards."""
    where = tmp_path / "disk"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def free(where) -> int:
    stats = os.statvfs(where)
    return stats.f_bavail * stats.f_frsize


def fill(disk, leave: int) -> None:
    """Take all of `disk`'s room but `leave` bytes (a whole number of pages)."""
    with open(disk / "filler", "wb") as f:
        f.write(b"\0" * (free(disk) - leave))
    assert free(disk) == leave


def model_bytes(config) -> int:
    job = Job(config)
    replica = job.build_replica(job.load_data(), torch.device("cpu"))
    return sum(t.nbytes for t in replica.model.state_dict().values())


def leftovers(where) -> list[str]:
    return sorted(p.name for p in where.rglob(".*.tmp"))


def test_a_failed_write_names_the_file_and_the_reason_and_leaves_nothing(disk):
    fill(disk, 2 * PAGE)
    with pytest.raises(WriteFailed) as failed:
        write_atomic(disk / "big.bin", b"x" * (3 * PAGE))
    assert str(failed.value) == f"cannot write {disk / 'big.bin'}: No space left on device"
    assert leftovers(disk) == [] and not (disk / "big.bin").exists() and free(disk) == 2 * PAGE


def test_metrics_that_cannot_be_appended_are_kept_and_written_at_the_end(disk, capsys):
    log = MetricsLog(disk / "metrics.jsonl")
    log.append({"time": 1.0, "test_accuracy": 0.5})
    fill(disk, 0)
    log.append({"time": 2.0, "test_accuracy": 0.6, "padding": "x" * PAGE})  # more than the page's rest
    log.append({"time": 3.0, "test_accuracy": 0.7})
    err = capsys.readouterr().err
    assert err == f"ako: cannot write {disk / 'metrics.jsonl'}: No space left on device; its records are kept in memory and written at the end\n"
    assert [json.loads(line)["time"] for line in (disk / "metrics.jsonl").read_text().splitlines()] == [1.0]
    (disk / "filler").unlink()
    log.write_pending()
    assert [json.loads(line)["time"] for line in (disk / "metrics.jsonl").read_text().splitlines()] == [1.0, 2.0, 3.0]


class _Runtime:
    """What `checkpoint.Checkpoints.save` reads of a server's runtime."""

    rank, world_size, state = 0, 1, None

    class mailbox:  # noqa: N801 - an attribute holder
        lost = ()

    @staticmethod
    def bytes_moved():
        return 0, 0


class _Shard:
    version = 0

    def state_dict(self):
        return {"params": torch.zeros(10_000)}  # 40 KB


def test_a_checkpoint_that_cannot_be_written_is_skipped_with_one_line(disk, capsys):
    calls = checkpoint.Checkpoints(_Runtime(), disk, 1.0, {})
    calls.save(3, _Shard())
    fill(disk, 4 * PAGE)
    calls.save(5, _Shard())  # does not raise: training goes on
    err = capsys.readouterr().err
    file = checkpoint.path(disk, 5, 0)
    assert err == (f"ako: checkpoint at step 5 skipped (cannot write {file}: No space left on device); training goes on, "
                   "the one at step 3 stays the latest complete\n")  # fmt: skip
    assert checkpoint.latest(disk, 1) == 3 and checkpoint.path(disk, 3, 0).is_file()
    assert leftovers(disk) == [] and free(disk) == 4 * PAGE
    assert sorted(p.name for p in checkpoint.directory(disk).iterdir()) == ["000000003"]  # no empty folder left


def test_a_disk_plainly_too_small_for_the_model_is_refused_before_anything_is_written(disk, capsys):
    config = small_config(disk)
    fill(disk, PAGE)
    code = main(["train", "--strategy", "allreduce", "--workers", "2", "--dataset", "digits", "--train-samples", "384",
                 "--test-samples", "60", "--epochs", "0.5", "--no-progress", "--out-dir", str(disk / "runs")])  # fmt: skip
    err = capsys.readouterr().err
    need = model_bytes(config)
    assert code == 2 and err.count("\n") == 1, err
    assert f"4 KB free on its file system ({disk}), and model.pt alone takes {need / 1e3:.0f} KB" in err
    assert not (disk / "runs").exists()


def test_a_model_that_does_not_fit_at_the_end_leaves_the_summary_and_says_so(disk, capfd):
    """Room for model.pt's numbers at the start (the check passes), not for the file once the
    run's config and metrics are written: the summary is written, says model.pt is not, and one
    line names the file and the reason; no temporary file is left."""
    config = small_config(disk)
    fill(disk, math.ceil(model_bytes(config) / PAGE) * PAGE)
    code = main(["train", "--strategy", "allreduce", "--workers", "2", "--dataset", "digits", "--train-samples", "384",
                 "--test-samples", "60", "--epochs", "0.5", "--no-progress", "--timeout", "1",
                 "--out-dir", str(disk / "runs")])  # fmt: skip
    out, err = capfd.readouterr()  # rank 0's process prints the summary
    (run_dir,) = (disk / "runs").iterdir()
    reason = f"cannot write {run_dir / 'model.pt'}: No space left on device; the model was kept in memory and tried again for 1 s"
    assert code == 1
    assert err.splitlines()[-1] == f"ako: the run finished, but {reason}", err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["not_saved"] == [reason] and summary["saved_model"]["file"] is None
    assert summary["saved_model"]["test_accuracy"] == summary["test_accuracy"] and f"not saved        {reason}" in out
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.toml", "metrics.jsonl", "summary.json"]
    assert leftovers(disk) == []


def test_a_disk_full_before_config_toml_leaves_no_run_directory(disk, capfd):
    """A disk full by the time rank 0 writes config.toml (filled after the start's check): the
    error names the file and the reason, and no empty run folder is left."""
    from ako.run import outcome

    config = small_config(disk)
    (disk / "runs").mkdir()
    fill(disk, 0)
    with pytest.raises(WriteFailed) as failed:
        outcome.open_run_dir(config, "allreduce", Job(config).load_data())
    assert str(failed.value).endswith("config.toml: No space left on device")
    assert list((disk / "runs").iterdir()) == []

