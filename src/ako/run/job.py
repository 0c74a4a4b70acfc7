"""What to train: the config plus the user's model factory and data sets, if any.

A `Job` is pickled to every worker process, so a user's `model_fn` must be importable (a
top-level function) and the data sets picklable. Both runtimes build replicas and data from it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler, Subset
from torch.utils.data import default_collate

from ako.config import CUSTOM, USER_FUNCTIONS, ConfigError, TrainConfig
from ako.data import DataError, load_dataset
from ako.data.text import TEXT_PREFIX, Vocabulary
from ako.models import build_model, model_options
from ako.optim import Optimization, OptimizerFn, SchedulerFn, warmup_steps
from ako.replica import EvalFn, LossFn, Replica, language_model_metrics
from ako.run import preflight
from ako.run.imports import call_factory, first_line, import_factory, is_spec, spec_of
from ako.strategies import STRATEGIES, Strategy


@dataclass
class Data:
    """Training and test sets, the collate function that makes their batches (None: `fetch`'s
    default), and for the built-in models the input shape (C, H, W) and class count."""

    train: torch.utils.data.Dataset
    test: torch.utils.data.Dataset
    input_shape: tuple[int, ...] | None
    num_classes: int | None
    name: str
    notice: str | None = None
    collate_fn: Callable | None = None
    standardisation: tuple[float, float] | None = None  # a built-in set's (mean, std) in pixel units
    source: str | None = None  # a built-in set's: the folder of its files, or "scikit-learn bundled digits"
    vocabulary: Vocabulary | None = None  # a text data set's: its samples are (context,) token ids

    @property
    def tokens_per_sample(self) -> int | None:
        """Tokens in one sample of a text data set (its context); None for other data."""
        return None if self.vocabulary is None else self.input_shape[0]


@dataclass
class Job:
    """A training run: `config`, and optionally the user's own strategy and training step.

    model_fn() -> nn.Module (default: `config.model`, a built-in or `package.module:factory`);
    train_set/test_set: map-style data sets, or DataLoaders whose data set, collate function,
    batch size and num_workers are taken (default: `config.dataset`, a built-in or a factory
    returning both); loss_fn(model, batch) -> loss and eval_fn(model, batch) -> {metric: value}
    (default: cross-entropy, and loss and accuracy); optimizer_fn(params) -> Optimizer and
    scheduler_fn(optimizer) -> LRScheduler (default: `config.optimizer`, `config.lr_schedule`);
    collate_fn(list of samples) -> batch."""

    config: TrainConfig
    strategy: Strategy | None = None
    model_fn: Callable[[], nn.Module] | None = None
    train_set: torch.utils.data.Dataset | DataLoader | None = None
    test_set: torch.utils.data.Dataset | DataLoader | None = None
    loss_fn: LossFn | None = None
    eval_fn: EvalFn | None = None
    optimizer_fn: OptimizerFn | None = None
    scheduler_fn: SchedulerFn | None = None
    collate_fn: Callable | None = None

    def __post_init__(self):
        if self.strategy is None:
            self.strategy = STRATEGIES[self.config.strategy]
        if (self.train_set is None) != (self.test_set is None):
            raise ConfigError("give both train_set and test_set, or neither")
        c = self.config
        if self.model_fn is None and is_spec(c.model):
            self.model_fn = import_factory("model", c.model)
        for name in USER_FUNCTIONS:
            if getattr(self, name) is None and getattr(c, name) is not None:
                _not_custom(name, getattr(c, name))
                setattr(self, name, import_factory(name, getattr(c, name)))
        if self.model_fn is None:
            _not_custom("model", c.model, "model_fn")
        if self.train_set is None:
            _not_custom("dataset", c.dataset, "train_set and test_set")
        if self.train_set is not None:
            self.train_set, self.test_set = self._take_loaders(self.train_set, self.test_set)

    def _take_loaders(self, train, test) -> tuple:
        """The data sets of `train` and `test`, each a data set or a DataLoader; a DataLoader's
        collate function and (the training one's) batch size and loader processes go into this
        job. Raises ConfigError for one ako cannot shard."""
        if isinstance(train, DataLoader):
            batch_size = train.batch_size or getattr(train.batch_sampler, "batch_size", None)
            if batch_size is None:
                raise ConfigError("train_set: a DataLoader with batch_size=None (no batches) cannot be sharded into "
                                  "mini-batches; give it a batch_size, or pass the data set")  # fmt: skip
            self.config = replace(self.config, batch_size=batch_size, num_workers=train.num_workers)
        for given in (train, test):
            if isinstance(given, DataLoader) and given.collate_fn is not default_collate and self.collate_fn is None:
                self.collate_fn = given.collate_fn
        return _unpack("train_set", train), _unpack("test_set", test)

    def load_data(self) -> Data:
        """The data sets: the user's (given, or from a `package.module:factory` dataset), or a
        built-in one. Raises DataError or ConfigError."""
        c = self.config
        train, test, name = self.train_set, self.test_set, CUSTOM
        if train is None and is_spec(c.dataset):
            sets = call_factory("dataset", c.dataset, import_factory("dataset", c.dataset))
            if not (isinstance(sets, (tuple, list)) and len(sets) == 2):
                raise ConfigError(f"dataset {c.dataset!r}: the factory must return (train_set, test_set), "
                                  f"got {type(sets).__name__}")  # fmt: skip
            train, test = self._take_loaders(*sets)
            train, test, name = _first(train, c.train_samples), _first(test, c.test_samples), c.dataset
        if train is not None:
            shape, classes = (None, None) if self.model_fn is not None else _shape_and_classes(train)
            return Data(train, test, shape, classes, name, collate_fn=self.collate_fn)
        split = load_dataset(c.dataset, c.data_dir, c.train_samples, c.test_samples, c.context)
        return Data(split.train, split.test, split.input_shape, split.num_classes, split.name, split.notice,
                    self.collate_fn, split.standardisation, split.source, split.vocabulary)  # fmt: skip

    def resolved(self, data: Data) -> Job:
        """This job as it really runs: with the data set `auto` chose (and the folder its
        files came from, as data_dir), the model by its
        `module:factory` name where it has one (else "custom"), and the user's functions by
        theirs, so that config.toml names them for a resume."""
        names = {name: self.name_of(name) for name in USER_FUNCTIONS}
        dataset = data.name
        if data.vocabulary is not None:  # text names its own file or folder: absolute, for a resume from elsewhere
            dataset = f"{TEXT_PREFIX}{os.path.abspath(data.source)}" if data.name.startswith(TEXT_PREFIX) else data.name
        elif data.source is not None and os.path.isdir(data.source):  # where the IDX files were found: config.toml says
            names["data_dir"] = os.path.abspath(data.source)
        return replace(self, config=replace(self.config, dataset=dataset, model=self.model_name, **names))

    @property
    def model_name(self) -> str:
        """`config.model`, or the user's model_fn as `module:factory` (else "custom")."""
        if self.model_fn is None or is_spec(self.config.model):
            return self.config.model
        return spec_of(self.model_fn) or CUSTOM

    def name_of(self, function: str) -> str | None:
        """How config.toml names the user's `function` (one of USER_FUNCTIONS): as the config
        gives it, else as `module:function`, else "custom"; None when there is none."""
        given = getattr(self, function)
        if given is None or getattr(self.config, function) is not None:
            return getattr(self.config, function)
        return spec_of(given) or CUSTOM

    @property
    def optimizer_name(self) -> str:
        """The optimizer a checkpoint must have been written with: the configured one's name,
        or the user's optimizer_fn's."""
        return self.name_of("optimizer_fn") or self.config.optimizer

    def steps_per_epoch(self, data: Data) -> int:
        """Optimizer steps per worker per epoch: the shard's whole steps of `step_samples`."""
        c = self.config
        return len(data.train) // c.workers // c.step_samples

    def planned_steps(self, data: Data) -> int:
        """Optimizer steps per worker of the whole run (its epochs; the schedule's length)."""
        return max(1, round(self.config.epochs * self.steps_per_epoch(data)))

    def optimization(self, data: Data) -> Optimization:
        return Optimization(self.config, self.planned_steps(data), self.optimizer_fn, self.scheduler_fn,
                            self.strategy.averages_own_steps, self.strategy.steps_stale(self.config))  # fmt: skip

    def build_model(self, data: Data) -> nn.Module:
        """A fresh model, initialised from the run seed (identical on every worker). Raises
        ConfigError (one line) when the factory fails or gives no module."""
        c = self.config
        torch.manual_seed(c.seed)
        if self.model_fn is None:
            try:
                return build_model(c.model, data.input_shape, data.num_classes, **model_options(c.model, c))
            except (RuntimeError, ValueError) as e:  # a built-in model sizes its layers from the input shape
                raise ConfigError(f"model {self.model_name!r} cannot take inputs of shape {tuple(data.input_shape)}: "
                                  f"{str(e).splitlines()[0][:200]}") from None  # fmt: skip
        model = call_factory("model", self.model_name, self.model_fn)
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model {self.model_name!r}: the factory returned {type(model).__name__}, not an nn.Module")
        return model

    def build_replica(self, data: Data, device: torch.device) -> Replica:
        """A replica of a fresh model (`build_model`) with the run's optimizer and training step."""
        model = self.build_model(data).to(device)
        c = self.config
        eval_fn = self.eval_fn or (language_model_metrics if data.vocabulary is not None else None)
        return Replica(model, self.optimization(data), self.loss_fn, eval_fn, data.collate_fn, c.precision)

    def check(self, processes: int = 1, out_dir: bool = True) -> tuple[Data, Replica]:
        """Everything about the job itself that can fail before processes start
        (`ako.run.preflight`), `processes` of them on this machine; the output folder is made
        last (unless not `out_dir`). Returns the loaded data and a replica of the model. Raises
        ConfigError or DataError with a one-line message."""
        return preflight.check(self, processes, out_dir)

    def identity(self, numel: int, dataset: str) -> dict:
        """What a checkpoint must agree with for this job to resume from it: `dataset` is the
        data's name (`Data.name`; a user's data set in memory is "custom"), before `numel`, the
        parameter count, so that a resume onto other data names the data."""
        c = self.config
        world = c.workers + (c.servers or 0)
        return {"strategy": self.strategy.name, "model": self.model_name, "optimizer_name": self.optimizer_name,
                "dataset": dataset, "numel": numel, "world": world}  # fmt: skip

    def validate(self, data: Data, replica: Replica) -> None:
        """The settings that depend on the data and the model: the strategy's options against
        the `replica` (its parameter count and modules), the batch size against a worker's
        shard. Raises ConfigError."""
        c = self.config
        if self.strategy.check is not None:
            self.strategy.check(c, replica)
        shard = len(data.train) // c.workers
        if c.step_samples > shard:
            what = f"batch_size {c.batch_size}" + (f" x accumulate {c.accumulate}" if c.accumulate > 1 else "")
            raise ConfigError(
                f"{what}: must be at most the per-worker shard of "
                f"{len(data.train)} // {c.workers} workers = {shard} samples"
            )
        if len(data.test) == 0:
            raise DataError(f"data set {data.name!r}: the test set is empty")
        warm, planned = warmup_steps(c, self.steps_per_epoch(data)), self.planned_steps(data)
        if self.scheduler_fn is None and warm > planned:
            raise ConfigError(f"warmup {c.warmup}: {warm} optimizer steps, longer than the run's {planned}")
        if c.strategy == "ako" and isinstance(c.partitions, int) and c.partitions > planned:
            raise ConfigError(f"partitions {c.partitions}: more than the run's {planned} steps a worker (each partition "
                              f"is exchanged once every p steps): at most {planned}")  # fmt: skip


def _not_custom(setting: str, value, give: str | None = None) -> None:
    """Raise ConfigError for "custom": a run whose function or data lived in `__main__` (no
    importable name), which only the same script can give again."""
    if value == CUSTOM:
        raise ConfigError(f"{setting} 'custom': the run's {setting} had no importable name (a function of __main__ "
                          f"or data in memory): resume it with ako.train(..., {give or setting}=...) from its script")


def _shape_and_classes(dataset) -> tuple[tuple[int, ...], int]:
    """A built-in model's input shape and class count from a user's data set of (x, label)
    pairs: x's shape, and 1 + the largest label. Raises ConfigError for other samples."""
    try:
        x, _ = dataset[0]
        if isinstance(dataset, torch.utils.data.TensorDataset):
            return tuple(x.shape), int(dataset.tensors[1].max()) + 1
        return tuple(x.shape), 1 + max(int(dataset[i][1]) for i in range(len(dataset)))
    except (TypeError, ValueError, AttributeError):
        raise ConfigError("a built-in model needs samples of (x, label); give your own model for other data") from None
    except Exception as e:  # the user's data set failed to give a sample
        raise ConfigError(f"the training set failed on a sample: {type(e).__name__}: {first_line(e)}") from None


def _unpack(role: str, given):
    """The map-style data set of `given` (itself, or a DataLoader's). Raises ConfigError for a
    DataLoader whose sampler or data set ako cannot shard, or something that is no data set."""
    dataset = given.dataset if isinstance(given, DataLoader) else given
    if isinstance(dataset, IterableDataset):
        raise ConfigError(f"{role}: an IterableDataset cannot be sharded by index; give a map-style data set "
                          "(one with __getitem__ and __len__)")  # fmt: skip
    if isinstance(given, DataLoader):
        batches, sampler = given.batch_sampler, given.sampler
        if type(batches) is not BatchSampler or type(sampler) not in (RandomSampler, SequentialSampler):
            custom = sampler if type(batches) is BatchSampler else batches
            raise ConfigError(
                f"{role}: a DataLoader with its own sampler ({type(custom).__name__}) cannot be sharded: ako gives "
                "each worker its own shard, reshuffled every epoch; pass a DataLoader without a sampler, or the data set"
            )
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise ConfigError(f"{role}: {type(given).__name__} is not a data set: give a map-style Dataset or a DataLoader")
    return dataset


def _first(dataset, samples: int | None):
    """The first `samples` examples of `dataset` (all when None)."""
    return dataset if samples is None or samples >= len(dataset) else Subset(dataset, range(samples))
