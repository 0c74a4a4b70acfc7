"""Tests for ako.run.board: evaluation records written to TensorBoard event files and read back."""

from __future__ import annotations

import sys

import pytest
from tensorboard.backend.event_processing import event_accumulator

from ako.checks import ConfigError
from ako.run.board import Board

START = 1_700_000_000.0  # a realistic Unix time, so float rounding of wall times would show


def _read(run_dir):
    """{tag: [(wall_time - START, step, value), ...]} of the run's event files."""
    accumulator = event_accumulator.EventAccumulator(str(run_dir / "tensorboard"))
    accumulator.Reload()
    return {
        tag: [(event.wall_time - START, event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def _record(time, samples, loss, accuracy, **extra):
    return dict(time=time, wall=time + 0.25, epoch=samples / 12800, samples=samples, bytes_sent=100 * samples,
                bytes_received=200 * samples, test_loss=loss, test_accuracy=accuracy, average_accuracy=accuracy - 0.01,
                consensus_distance=0.5 / samples, **extra)


def test_records_read_back_with_samples_as_step_and_training_seconds_as_relative_time(tmp_path):
    records = [
        _record(1.5, 6400, 0.9, 0.6),
        _record(3.25, 12800, 0.5, 0.8),
        _record(4.0, 19200, 0.25, 0.9, samples_per_second=1234.5),  # given: not replaced by samples / time
    ]
    board = Board(tmp_path, START)
    for record in records:
        board.add(record)
    board.close()

    scalars = _read(tmp_path)
    assert sorted(scalars) == [
        "average/accuracy", "test/accuracy", "test/loss", "train/bytes_received", "train/bytes_sent",
        "train/consensus_distance", "train/epoch", "train/samples_per_second",
    ]
    expected = {
        "test/loss": [0.9, 0.5, 0.25],
        "test/accuracy": [0.6, 0.8, 0.9],
        "average/accuracy": [0.59, 0.79, 0.89],
        "train/epoch": [0.5, 1.0, 1.5],
        "train/bytes_sent": [640_000, 1_280_000, 1_920_000],
        "train/bytes_received": [1_280_000, 2_560_000, 3_840_000],
        "train/consensus_distance": [0.5 / 6400, 0.5 / 12800, 0.5 / 19200],
        "train/samples_per_second": [6400 / 1.5, 12800 / 3.25, 1234.5],
    }
    for tag, values in expected.items():
        events = scalars[tag]
        assert [step for _, step, _ in events] == [6400, 12800, 19200], tag
        assert [value for _, _, value in events] == pytest.approx(values, rel=1e-6), tag  # stored as float32
        for (relative, _, _), record in zip(events, records):
            assert relative == pytest.approx(record["time"], abs=1e-3), tag


def test_none_strings_and_booleans_are_skipped(tmp_path):
    board = Board(tmp_path, START)
    board.add({"time": 0.0, "wall": 0.1, "samples": 0, "test_loss": None, "test_accuracy": 0.1, "strategy": "ako",
               "note": "start", "final": True, "average_accuracy": None})
    board.close()

    # time 0: no samples_per_second either, rather than a division by zero
    assert _read(tmp_path) == {"test/accuracy": [(0.0, 0, pytest.approx(0.1))]}


def test_missing_tensorboard_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes the import raise ImportError
    with pytest.raises(ConfigError, match=r"^tensorboard: the tensorboard package is not installed"):
        Board(tmp_path, START)
    assert not (tmp_path / "tensorboard").exists()
