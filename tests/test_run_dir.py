"""The run directory: one writer at a time (a lock the kernel drops when its holder ends), and
bad input about it is one line that leaves nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from helpers import small_config
from own_training import loss_checking_the_lock
from test_checkpoint import checkpointed_run

import ako
from ako.data import write_idx
from ako.cli import main
from ako.run import lock


def _holder(run_dir) -> subprocess.Popen:
    """Another process holding `run_dir`'s lock, as a running `ako train` does."""
    code = f"from ako.run import lock; lock.hold({str(run_dir)!r}); print('held', flush=True); import time; time.sleep(120)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def test_a_resume_of_a_run_being_written_is_refused_in_one_line_until_its_writer_dies(tmp_path, capsys):
    run_dir = checkpointed_run(tmp_path, strategy="allreduce")
    holder = _holder(run_dir)
    try:
        code = main(["train", "--resume", str(run_dir), "--epochs", "2"])
        err = capsys.readouterr().err
        assert code == 2 and err == (f"ako: error: resume {str(run_dir)!r}: another ako process is training into it now (it "
                                     "holds the run directory's lock); wait for it to end, or stop it first\n")  # fmt: skip
        assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "config.toml"]  # nothing written
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    lock.check_free(run_dir)  # kill -9 dropped it: no stale lock


def test_a_run_holds_its_directory_s_lock_while_it_trains_and_drops_it_at_the_end(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    monkeypatch.setenv("AKO_TEST_RUNS", str(runs))
    result = ako.train(small_config(tmp_path, strategy="allreduce"), loss_fn=loss_checking_the_lock)
    assert result.summary["iterations"] == 6
    lock.check_free(result.summary["run_dir"])


def test_a_resume_from_a_file_says_it_is_a_file(tmp_path, capsys):
    run_dir = checkpointed_run(tmp_path, strategy="allreduce")
    file = run_dir / "config.toml"
    code = main(["train", "--resume", str(file)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"resume {str(file)!r}: a file, not a run directory" in err


def test_a_resume_onto_another_data_set_names_the_data_set(tmp_path, capsys):
    run_dir = checkpointed_run(tmp_path, strategy="allreduce")
    data = tmp_path / "data"  # a small IDX set of 8x8 images, which the digits cnn takes
    data.mkdir()
    images, labels = np.zeros((400, 8, 8), np.uint8), np.arange(400, dtype=np.uint8) % 10
    for split in ("train", "t10k"):
        write_idx(data / f"{split}-images-idx3-ubyte", images, gz=False)
        write_idx(data / f"{split}-labels-idx1-ubyte", labels, gz=False)
    code = main(["train", "--resume", str(run_dir), "--dataset", "fashion-mnist", "--data-dir", str(data), "--epochs", "2"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "written by a run with dataset 'digits', not 'fashion-mnist'" in err


def test_an_over_long_out_dir_is_one_line_and_leaves_no_parent_behind(tmp_path, capsys):
    out = tmp_path / "new" / "parent" / ("x" * 300)
    code = main(["train", "--strategy", "allreduce", "--workers", "2", "--dataset", "digits", "--train-samples", "384",
                 "--test-samples", "60", "--epochs", "0.5", "--no-progress", "--out-dir", str(out)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err == f"ako: error: out_dir {str(out)!r}: cannot make it (File name too long)\n"
    assert list(tmp_path.iterdir()) == []
