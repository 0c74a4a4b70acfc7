"""TensorBoard event files of a run's evaluation records, in `<run dir>/tensorboard`, so that
`tensorboard --logdir` plots them against samples (STEP) and training seconds (RELATIVE)."""

from __future__ import annotations

import pathlib

from ako.checks import ConfigError

_AXES = ("time", "wall", "samples")  # the axes of every scalar, not scalars themselves
_GROUPS = ("test_", "average_", "centre_", "train_")


class Board:
    """Writes each evaluation record's numeric fields as scalars: step = samples trained on,
    wall time = `start` + the record's training seconds."""

    def __init__(self, run_dir: pathlib.Path, start: float):
        """`start`: the Unix time (seconds) training began; TensorBoard's RELATIVE axis counts from it."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            message = "tensorboard: the tensorboard package is not installed (pip install tensorboard)"
            raise ConfigError(message) from None
        self.start = start
        self.writer = SummaryWriter(log_dir=str(pathlib.Path(run_dir) / "tensorboard"))

    def add(self, record: dict) -> None:
        """One record: "time" (training seconds), "samples" (samples trained on), and any other fields (bytes for
        "bytes_*"); None, bool and non-numeric values are skipped."""
        samples, seconds = record["samples"], record["time"]
        scalars = {key: value for key, value in record.items() if key not in _AXES and _numeric(value)}
        if "samples_per_second" not in record and seconds > 0:
            scalars["samples_per_second"] = samples / seconds
        for key, value in scalars.items():
            group = next((g for g in _GROUPS if key.startswith(g)), None)
            tag = f"{group[:-1]}/{key[len(group):]}" if group else f"train/{key}"
            self.writer.add_scalar(tag, value, global_step=samples, walltime=self.start + seconds)
        # One record per evaluation: flushing each keeps a live TensorBoard current at little cost.
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()


def _numeric(value) -> bool:
    # bool is an int subclass, but a flag is not a curve worth plotting.
    return isinstance(value, (int, float)) and not isinstance(value, bool)
