"""What to train: the config plus the user's model factory and data sets, if any.

A `Job` is pickled to every worker process, so a user's `model_fn` must be importable (a
top-level function) and the data sets picklable. Both runtimes build replicas and data from it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from ako.config import ConfigError, TrainConfig
from ako.data import DataError, load_dataset
from ako.models import build_model
from ako.replica import OptimizerConfig, Replica
from ako.strategies import STRATEGIES, Strategy


@dataclass
class Data:
    """Training and test sets with the input shape (C, H, W) and class count models need."""

    train: torch.utils.data.Dataset
    test: torch.utils.data.Dataset
    input_shape: tuple[int, ...]
    num_classes: int
    name: str
    notice: str | None = None


@dataclass
class Job:
    """A training run: `config`, and optionally the user's own strategy, model factory
    (`model_fn() -> nn.Module`) and map-style data sets `train_set`/`test_set` yielding
    (x, label) pairs. When data sets are given, `config.dataset` is ignored."""

    config: TrainConfig
    strategy: Strategy | None = None
    model_fn: Callable[[], nn.Module] | None = None
    train_set: torch.utils.data.Dataset | None = None
    test_set: torch.utils.data.Dataset | None = None

    def __post_init__(self):
        if self.strategy is None:
            self.strategy = STRATEGIES[self.config.strategy]
        if (self.train_set is None) != (self.test_set is None):
            raise ConfigError("give both train_set and test_set, or neither")

    def load_data(self) -> Data:
        """The data sets: the user's, or the configured data set (raises DataError)."""
        c = self.config
        if self.train_set is not None:
            x, _ = self.train_set[0]
            classes = _count_classes(self.train_set)
            return Data(self.train_set, self.test_set, tuple(x.shape), classes, "custom")
        split = load_dataset(c.dataset, c.data_dir, c.train_samples, c.test_samples)
        return Data(split.train, split.test, split.input_shape, split.num_classes, split.name, split.notice)

    def resolved(self, data: Data) -> Job:
        """This job as it really runs: with the data set `auto` chose, and model "custom" for
        a user's own model factory."""
        model = "custom" if self.model_fn is not None else self.config.model
        return replace(self, config=replace(self.config, dataset=data.name, model=model))

    def build_replica(self, data: Data, device: torch.device) -> Replica:
        """A replica with the model initialised from the run seed (identical on every worker)."""
        torch.manual_seed(self.config.seed)
        if self.model_fn is not None:
            model = self.model_fn()
        else:
            model = build_model(self.config.model, data.input_shape, data.num_classes)
        c = self.config
        return Replica(model.to(device), OptimizerConfig(c.lr, c.momentum, c.nesterov, c.weight_decay))

    def check(self) -> tuple[Data, int]:
        """Everything about the job itself that can fail before processes start; returns the
        loaded data and the model's parameter count. Raises ConfigError or DataError with a
        one-line message."""
        data = self.load_data()
        try:
            replica = self.build_replica(data, torch.device("cpu"))
            replica.model(data.train[0][0].unsqueeze(0))
        except (RuntimeError, ValueError) as e:
            raise ConfigError(
                f"model {self.config.model!r} cannot take inputs of shape {tuple(data.input_shape)}: "
                f"{str(e).splitlines()[0][:200]}"
            ) from None
        self.validate(data, replica.numel)
        check_out_dir(self.config.out_dir)
        return data, replica.numel

    def identity(self, numel: int) -> dict:
        """What a checkpoint must agree with for this job to resume from it."""
        c = self.config
        model = "custom" if self.model_fn is not None else c.model
        world = c.workers + (c.servers or 0)
        return {"strategy": self.strategy.name, "model": model, "numel": numel, "world": world}

    def validate(self, data: Data, numel: int) -> None:
        """The settings that depend on the data and the model: the strategy's options against
        the parameter count `numel`, the batch size against a worker's shard. Raises ConfigError."""
        c = self.config
        if self.strategy.check is not None:
            self.strategy.check(c, numel)
        shard = len(data.train) // c.workers
        if c.batch_size > shard:
            raise ConfigError(
                f"batch_size {c.batch_size}: must be at most the per-worker shard of "
                f"{len(data.train)} // {c.workers} workers = {shard} samples"
            )
        if len(data.test) == 0:
            raise DataError(f"data set {data.name!r}: the test set is empty")


def check_out_dir(out_dir: str) -> None:
    """Make `out_dir` (the last check before a run starts); raise ConfigError if it cannot be
    made or written to."""
    path = Path(out_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"out_dir {out_dir!r}: cannot make it ({e.strerror})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"out_dir {out_dir!r}: not writable")


def _count_classes(dataset) -> int:
    """Number of classes of a user's data set: 1 + the largest label."""
    if isinstance(dataset, torch.utils.data.TensorDataset):
        return int(dataset.tensors[1].max()) + 1
    return 1 + max(int(dataset[i][1]) for i in range(len(dataset)))
