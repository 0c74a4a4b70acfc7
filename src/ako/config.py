"""Run configuration: one dataclass, TOML load and save, validation with one-line messages.

Precedence: defaults < `--config file.toml` < command-line flags. `validate` checks everything
that can be checked before a process starts, so bad input fails fast with `ConfigError` (the
CLI prints its one-line message and exits with status 2).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tomllib
from dataclasses import dataclass, fields
from typing import NamedTuple

import tomli_w
import torch

from ako.checks import ConfigError, choice, integer, number, show
from ako.cluster import ClusterError, check_stragglers
from ako.data.datasets import DATASETS
from ako.data.text import is_text
from ako.models import GPT_OPTIONS, MODELS
from ako.strategies import STRATEGIES as REGISTRY

STRATEGIES = tuple(REGISTRY)
PARAMETER_SERVER = tuple(name for name, s in REGISTRY.items() if s.server is not None)
# settings only the simulated runtime takes (`ako train` rejects them)
SIMULATE_OPTIONS = ("latency", "seconds_per_sample", "profile")
SECONDS_PER_SAMPLE_MAX = 1e3  # a simulated worker's compute cost: at most this many seconds a sample
TRAIN_OPTIONS = ("checkpoint_every", "resume")  # `ako train` only: the simulator does not fail
BACKENDS = ("auto", "gloo", "nccl")
MAX_LATENCY = 60.0  # seconds a message may take to arrive: more is no link


@dataclass
class TrainConfig:
    """Everything that defines a training run. Units: seconds, bytes per second, epochs."""

    strategy: str = "ako"
    workers: int = 2
    dataset: str = "fashion-mnist"
    data_dir: str | None = None
    train_samples: int | None = None  # use only the first k training examples (quick runs)
    test_samples: int | None = None
    model: str = "cnn"
    context: int = 128  # text data: tokens per sequence (a sample), and the gpt model's context
    layers: int = 4  # gpt: transformer blocks
    heads: int = 4  # gpt: attention heads
    width: int = 128  # gpt: embedding width (a multiple of heads)
    dropout: float = 0.0  # gpt: dropout rate
    batch_size: int = 64  # per worker, per micro-batch (`accumulate` of them per optimizer step)
    accumulate: int = 1  # micro-batches per optimizer step (gradient accumulation)
    num_workers: int = 0  # data-loading processes per worker (torch DataLoader's num_workers)
    precision: str = "fp32"  # "bf16" (autocast) or "fp16" (autocast and a loss scale; CUDA only)
    optimizer: str = "sgd"  # a torch.optim optimizer by name (ako.optim.OPTIMIZERS)
    lr: float | None = None  # of the averaged gradient; None = sgd's 0.1, else torch's default
    momentum: float | None = None  # None = sgd's 0.9 (optimizers that take it)
    nesterov: bool | None = None  # Nesterov momentum; None = sgd's true
    weight_decay: float | None = None  # None = sgd's 5e-4, else torch's default
    optimizer_args: dict | None = None  # the optimizer's other settings, e.g. {betas = [0.9, 0.95]}
    lr_schedule: str = "constant"  # "step", "cosine" or "linear", stepped once per optimizer step
    warmup: str | None = None  # linear warm-up: optimizer steps ("500") or epochs ("0.5epochs")
    lr_scaling: str = "auto"  # "linear": lr x workers (Goyal et al. 2017); "sqrt"; auto: sqrt for local adaptive steps
    lr_gamma: float = 0.1  # step schedule: the factor every lr_decay_epochs
    lr_decay_epochs: float = 1.0  # step schedule: epochs between decays
    epochs: float = 2.0
    max_time: float | None = None  # seconds of training
    target_accuracy: float | None = None  # stop when rank 0's test accuracy reaches it
    target: str | None = None  # stop when an evaluated metric passes a bound, e.g. "loss<=0.3"
    loss_fn: str | None = None  # your training loss as "package.module:function" (model, batch) -> loss
    eval_fn: str | None = None  # your evaluation, "package.module:function" (model, batch) -> {metric: value}
    collate_fn: str | None = None  # your collate function, "package.module:function" (samples) -> batch
    optimizer_fn: str | None = None  # your optimizer, "package.module:function" (params) -> Optimizer
    scheduler_fn: str | None = None  # your schedule, "package.module:function" (optimizer) -> LRScheduler
    eval_every: float = 0.5  # epochs between evaluations
    partitions: int | str = "auto"  # ako: p, or "auto"
    exchange: str = "auto"  # ako: how windows travel: "all-to-all", "ring", or "auto" (by the number of workers)
    update: str = "auto"  # ako: what a window carries: "deltas", "gradients", or "auto" (deltas for sgd)
    staleness: int | str | None = None  # ako: bound s (0 = lock-step) or auto (the default); ssp: s (default 2)
    bandwidth: str | None = None  # link budget, e.g. "1Gbit" or "50MB"; measured when None (simulate: every link's rate, free when None)
    servers: int | None = None  # parameter-server strategies: server processes (default 1)
    micro_batch: int | None = None  # absp, ako: samples per interruptible micro-batch (default batch_size // 4)
    tau: int | str | None = None  # easgd: steps between elastic rounds, or "auto" (default); gossip: between gossip rounds (1)
    beta: float = 0.9  # easgd: moving rate; elastic alpha = beta / workers
    gossip: str = "pull"  # gossip: "pull" (average with a peer's snapshot) or "push-sum"
    peers: str = "random"  # gossip: peer selection, "random" or "rotating"
    sync_every: int | None = None  # diloco, streaming-diloco: H, inner steps between syncs (default 100)
    outer_lr: float | None = None  # diloco, streaming-diloco: the outer Nesterov SGD's learning rate (0.7)
    outer_momentum: float | None = None  # diloco, streaming-diloco: its momentum (0.9)
    fragments: int | None = None  # streaming-diloco: P, fragments synced in turn (4)
    fragment_delay: int | None = None  # streaming-diloco: tau, steps a fragment's sync overlaps (1)
    fragment_alpha: float | None = None  # streaming-diloco: alpha, the local fragment's share after a sync (0.5)
    fragment_cut: str = "slices"  # streaming-diloco: "slices" of the flat vector or whole "modules"
    compress: str | None = None  # diloco, streaming-diloco, ako: "none", "bf16", "int8" or "fp4" on the wire (ako: or "auto", its default; the others: "none")
    straggler: tuple[str, ...] = ()  # e.g. ("rank=1,factor=3", "prob=0.1,factor=2"); see ako.cluster
    timeout: float = 60.0  # seconds any wait may take before the run fails
    seed: int = 0
    backend: str = "auto"
    out_dir: str = "runs"
    progress: bool | None = None  # progress bar: None = only on a terminal
    tensorboard: bool = False  # also write the evaluations as TensorBoard event files (run_dir/tensorboard)
    # `ako train` only (TRAIN_OPTIONS): checkpoints and resuming from them
    checkpoint_every: str | None = None  # e.g. "30s" or "5min"; None = no checkpoints
    resume: str | None = None  # a run directory to continue from its last complete checkpoint
    # `ako simulate` only (SIMULATE_OPTIONS): per-message latency, compute speed, cluster profile
    latency: str | None = None  # e.g. "100us"; None = 0
    seconds_per_sample: float | None = None  # forward+backward seconds per sample of one worker
    profile: str | None = None  # a cluster profile written by `ako calibrate`

    @property
    def step_samples(self) -> int:
        """Samples a worker takes per optimizer step: batch_size x accumulate."""
        return self.batch_size * self.accumulate

    @property
    def goal(self) -> Target | None:
        """The run's target as (metric, comparison, value): `target`, or `target_accuracy` as
        accuracy >= value; None when the run has none."""
        if self.target is not None:
            return parse_target(self.target)
        return None if self.target_accuracy is None else Target("accuracy", ">=", self.target_accuracy)

    @property
    def bandwidth_bytes(self) -> float | None:
        """The link budget in bytes per second, or None to measure it."""
        return None if self.bandwidth is None else parse_bandwidth(self.bandwidth)

    @property
    def checkpoint_seconds(self) -> float | None:
        """Seconds of training between checkpoints, or None for none."""
        return None if self.checkpoint_every is None else parse_duration(self.checkpoint_every)

    @property
    def latency_seconds(self) -> float:
        """The simulated per-message latency in seconds (0 when not set)."""
        return 0.0 if self.latency is None else parse_latency(self.latency)


FIELDS = {f.name: f for f in fields(TrainConfig)}
PRECISIONS = ("fp32", "bf16", "fp16")
USER_FUNCTIONS = ("loss_fn", "eval_fn", "collate_fn", "optimizer_fn", "scheduler_fn")  # named as module:function
CUSTOM = "custom"  # what config.toml says of a model, data set or function that has no importable name


class Target(NamedTuple):
    """A bound on an evaluated metric: `metric` (a key of the evaluation, e.g. "accuracy"),
    `op` ">=" or "<=", `value`."""

    metric: str
    op: str
    value: float

    def met(self, metrics: dict) -> bool:
        """Whether `metrics` (name -> value) meets the bound (a missing metric does not)."""
        x = metrics.get(self.metric)
        if not isinstance(x, (int, float)) or not math.isfinite(x):
            return False
        return x >= self.value if self.op == ">=" else x <= self.value

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.value!r}"  # the shortest exact form: 0.9999995, 1


_TARGET = re.compile(r"^\s*([A-Za-z_][\w.-]*?)\s*(<=|>=)\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*$")


def parse_target(text: str) -> Target:
    """Parse a target such as "accuracy>=0.85" or "loss<=0.3". Raises ConfigError."""
    match = _TARGET.match(str(text))
    if not match:
        raise ConfigError(f"target {show(text)}: expected a metric, >= or <=, and a number, like loss<=0.3 or accuracy>=0.85")
    value = float(match.group(3))
    if not math.isfinite(value):
        raise ConfigError(f"target {show(text)}: the bound must be a finite number")
    return Target(match.group(1), match.group(2), int(value) if value.is_integer() else value)

_UNITS = {"bit": 1 / 8, "b": 1 / 8, "byte": 1, "B": 1}
_PREFIX = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_BANDWIDTH = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKMGT]?)(bit|byte|b|B)?(?:/s|ps)?\s*$")


def parse_bandwidth(text: str) -> float:
    """Parse a link rate such as "1Gbit", "100Mbit/s", "12.5MB" or "800000" (bytes/s).

    Returns bytes per second. Raises ConfigError for anything else or a rate <= 0.
    """
    match = _BANDWIDTH.match(str(text))
    if not match:
        raise ConfigError(
            f"bandwidth {text!r}: expected a rate like 1Gbit, 100Mbit, 12.5MB or a number of bytes/s"
        )
    value, prefix, unit = match.groups()
    rate = float(value) * _PREFIX[prefix] * _UNITS[unit or "B"]
    if not 1 <= rate < math.inf:
        raise ConfigError(f"bandwidth {text!r}: must be at least 1 byte/s and finite")
    return rate


_LATENCY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(s|ms|us|µs|ns)?\s*$")
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(s|min|h)?\s*$")
_DURATION_UNITS = {"s": 1.0, "min": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Parse a period such as "30s", "5min", "1h" or "90" (seconds); returns seconds.
    Raises ConfigError for anything else, or a period outside (0, 1e6] seconds."""
    match = _DURATION.match(str(text))
    if not match:
        raise ConfigError(f"checkpoint_every {text!r}: expected a period like 30s, 5min or 1h")
    seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2) or "s"]
    if not 0 < seconds <= 1e6:
        raise ConfigError(f"checkpoint_every {text!r}: must be more than 0 s and at most 1e6 s")
    return seconds


def parse_latency(text: str) -> float:
    """Parse a latency such as "100us", "0.5ms", "2e-4s" or "0.0001" (seconds).

    Returns seconds, from 0 to MAX_LATENCY. Raises ConfigError for anything else."""
    match = _LATENCY.match(str(text))
    if not match:
        raise ConfigError(f"latency {text!r}: expected a time like 100us, 0.5ms or 0.001s")
    value, unit = match.groups()
    seconds = float(value) * _TIME_UNITS[unit or "s"]
    if not seconds <= MAX_LATENCY:  # also infinity from a huge number
        raise ConfigError(f"latency {text!r}: must be at most {MAX_LATENCY:g} s")
    return seconds


def run_config(run_dir, what: str = "resume") -> str:
    """The path of run directory `run_dir`'s config.toml. Raises ConfigError, naming the
    setting `what`, when there is no such directory or it holds no config.toml."""
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise ConfigError(f"{what} {str(run_dir)!r}: a file, not a run directory (give the folder a run made, "
                          "which holds its config.toml and checkpoints)")  # fmt: skip
    if not os.path.isdir(run_dir):
        raise ConfigError(f"{what} {str(run_dir)!r}: no such directory")
    path = os.path.join(run_dir, "config.toml")
    if not os.path.isfile(path):
        raise ConfigError(f"{what} {str(run_dir)!r}: not a run directory (no config.toml in it)")
    return path


def load_toml(path: str | os.PathLike) -> dict:
    """Read a config file into a dict of TrainConfig fields (a key's dashes read as
    underscores). Raises ConfigError on unknown keys, one setting given twice (`batch-size`
    and `batch_size`), a missing file or TOML syntax errors."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(path)!r}: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r}: cannot read it ({e})") from None
    data = underscored(f"config file {str(path)!r}", data)
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise ConfigError(
            f"config file {str(path)!r}: unknown key {unknown[0]!r}; allowed: {', '.join(FIELDS)}"
        )
    return data


def underscored(where: str, table: dict) -> dict:
    """`table` with each key's dashes read as underscores (`batch-size` is `batch_size`).
    Raises ConfigError, naming `where`, when both spellings of one key are given."""
    out = {}
    for key, value in table.items():
        if (name := key.replace("-", "_")) in out:
            raise ConfigError(f"{where}: {name!r} is given twice, spelled with - and with _")
        out[name] = value
    return out


def option_users() -> dict[str, tuple[str, ...]]:
    """Each strategy option's name, with the strategies that declare it (registry order).
    Setting one for another strategy is a mistake worth an error."""
    users: dict[str, tuple[str, ...]] = {}
    for name, strategy in REGISTRY.items():
        for option in strategy.options:
            users[option.name] = users.get(option.name, ()) + (name,)
    return users


def validate(config: TrainConfig, simulated: bool = False, given: frozenset[str] = frozenset()) -> TrainConfig:
    """Check every field's type and range; return the config with values normalised
    (e.g. partitions "3" -> 3). `simulated`: for `ako simulate`, which takes SIMULATE_OPTIONS
    and a bandwidth (the link rate) for every strategy. A strategy option of another strategy
    is refused unless it is at a default (a config file of one strategy's run serves another),
    and refused whatever its value when its name is in `given` (the CLI's flags). Raises
    ConfigError naming the first bad value."""
    c = dataclasses.replace(config)
    _validate_simulation(c, simulated)
    for field in dataclasses.fields(c):  # no path, name or module may hold one: the OS refuses it
        if isinstance(getattr(c, field.name), str) and "\0" in getattr(c, field.name):
            raise ConfigError(f"{field.name} {getattr(c, field.name)!r}: contains a NUL character")
    for name in ("strategy", "dataset", "model", "backend", "out_dir"):
        if not isinstance(getattr(c, name), str) or not getattr(c, name):
            raise ConfigError(f"{name} {show(getattr(c, name))}: must be a non-empty string")
    for name in USER_FUNCTIONS:
        value = getattr(c, name)
        if value is not None and not (isinstance(value, str) and (":" in value or value == CUSTOM)):
            raise ConfigError(f"{name} {show(value)}: expected package.module:function")
    if c.data_dir is not None and not (isinstance(c.data_dir, str) and c.data_dir):
        raise ConfigError(f"data_dir {show(c.data_dir)}: must be a directory path")
    choice("strategy", c.strategy, STRATEGIES)
    if ":" not in c.model and c.model != CUSTOM and c.model not in MODELS:  # else the job imports or refuses it
        raise ConfigError(f"unknown model {c.model!r}: choose one of {', '.join(MODELS)}, or give your own as package.module:factory")
    if ":" not in c.dataset and c.dataset != CUSTOM and c.dataset not in DATASETS:
        raise ConfigError(f"unknown data set {c.dataset!r}: choose one of {', '.join(DATASETS)}, text:PATH, "
                          "or give your own as package.module:factory")  # fmt: skip
    _validate_language_model(c, given)
    if c.data_dir is not None and c.dataset == "digits":
        raise ConfigError(f"data_dir {c.data_dir!r}: digits is bundled with scikit-learn and reads no files; "
                          "--data-dir is for the IDX data sets (fashion-mnist, mnist, auto)")  # fmt: skip
    choice("backend", c.backend, BACKENDS)
    _validate_training(c)
    allowed: dict[str, tuple] = {}  # every strategy's choices of each option (the run's own checks its own: `Option.resolve`)
    for option in (o for s in REGISTRY.values() for o in s.options if o.choices):
        allowed[option.name] = tuple(dict.fromkeys(allowed.get(option.name, ()) + option.choices))
    for name, choices in allowed.items():
        if getattr(c, name) is not None:
            choice(name, getattr(c, name), choices)
    if c.backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("backend 'nccl' needs CUDA, and torch.cuda.is_available() is false here: use gloo")
    for name, users in option_users().items():
        if name == "bandwidth" and simulated:
            continue  # the simulator's link rate, for every strategy
        value = getattr(c, name)
        if c.strategy in users:
            continue
        if name in given or not _is_default(name, value, c):
            typed = isinstance(value, str) and re.fullmatch(r"-?\d+(\.\d+)?", value) is not None  # a number as the CLI passes it
            raise ConfigError(
                f"{name} {value if typed else show(value)}: strategy {c.strategy} has no such option "
                f"(it is for {', '.join(users)})"
            )
        setattr(c, name, FIELDS[name].default)  # another strategy's default: not this run's (servers = 1 started a server)
    c.workers = integer("workers", c.workers, low=1, high=4096)
    c.batch_size = integer("batch_size", c.batch_size, low=1)
    c.seed = integer("seed", c.seed, low=0, high=2**63 - 1)
    for name in ("train_samples", "test_samples"):
        if getattr(c, name) is not None:
            setattr(c, name, integer(name, getattr(c, name), low=1))
    c.epochs = number("epochs", c.epochs, low=0.0, high=1e6, low_open=True)
    c.eval_every = number("eval_every", c.eval_every, low=0.0, high=1e6, low_open=True)
    c.timeout = number("timeout", c.timeout, low=1.0, high=86400.0)
    if c.max_time is not None:
        c.max_time = number("max_time", c.max_time, low=0.0, high=1e9, low_open=True)
    if c.target_accuracy is not None:
        c.target_accuracy = number("target_accuracy", c.target_accuracy, low=0.0, high=1.0, low_open=True)
    if c.target is not None:
        if c.target_accuracy is not None:
            raise ConfigError(f"target {show(c.target)}: give target or target_accuracy, not both")
        c.target = str(parse_target(c.target))
    if c.goal is not None and c.eval_fn is None:
        _check_reachable(c.goal)
    if c.bandwidth is not None:
        c.bandwidth = str(c.bandwidth)
        parse_bandwidth(c.bandwidth)
    _validate_cluster(c)
    for name in ("progress", "tensorboard"):
        if getattr(c, name) is not None and not isinstance(getattr(c, name), bool):
            raise ConfigError(f"{name} {show(getattr(c, name))}: must be true or false")
    return c


def _validate_language_model(c: TrainConfig, given: frozenset[str]) -> None:
    """The text and gpt settings: context for text data (or a gpt), the gpt's sizes for the gpt
    only (refused for another model when given, or not at their defaults), and a built-in
    image model refused on text."""
    c.context = integer("context", c.context, low=1, high=1 << 20)
    for name in ("layers", "heads", "width"):
        setattr(c, name, integer(name, getattr(c, name), low=1, high=1 << 16))
    c.dropout = number("dropout", c.dropout, low=0.0, high=1.0, high_open=True)
    if c.width % c.heads:
        raise ConfigError(f"width {c.width}: must be a multiple of heads ({c.heads})")
    text = is_text(c.dataset)
    if text and c.data_dir is not None:
        raise ConfigError(f"data_dir {c.data_dir!r}: a text data set names its file or folder itself (text:PATH); "
                          "--data-dir is for the IDX data sets (fashion-mnist, mnist, auto)")  # fmt: skip
    if text and c.model in MODELS and c.model != "gpt":
        raise ConfigError(f"model {c.model!r} is an image model: train text ({c.dataset}) with --model gpt, "
                          "or your own as package.module:factory")  # fmt: skip
    for name in ("context", *GPT_OPTIONS):
        users = (text or c.model == "gpt") if name == "context" else c.model == "gpt"
        if not users and (name in given or getattr(c, name) != FIELDS[name].default):
            what = "text data (--dataset fortunes or text:PATH) and the gpt model" if name == "context" else "the gpt model"
            raise ConfigError(f"{name} {getattr(c, name)}: only {what} take{'s' if name != 'context' else ''} it")


def _check_reachable(goal: Target) -> None:
    """Refuse a target the built-in evaluation can never meet: its accuracy is a fraction in
    [0, 1] and its loss, a cross-entropy, is at least 0. (A user's eval_fn may use any scale.)"""
    low, high = {"accuracy": (0.0, 1.0), "loss": (0.0, math.inf)}.get(goal.metric, (-math.inf, math.inf))
    if (goal.op == ">=" and goal.value > high) or (goal.op == "<=" and goal.value < low):
        scale = "a fraction in [0, 1]" if goal.metric == "accuracy" else "at least 0"
        raise ConfigError(f"target {str(goal)!r}: can never be met, as the {goal.metric} is {scale}")


def _validate_training(c: TrainConfig) -> None:
    """The optimizer, its schedule, precision, accumulation and data loading; fills in the
    optimizer's defaults (ako's for sgd, torch's for the others: `ako.optim`)."""
    from ako.optim import LR_SCALINGS, OPTIMIZERS, SCHEDULES, optimizer_kwargs, optimizer_settings, parse_warmup

    choice("optimizer", c.optimizer, OPTIMIZERS)
    choice("lr_schedule", c.lr_schedule, SCHEDULES)
    choice("lr_scaling", c.lr_scaling, LR_SCALINGS)
    choice("precision", c.precision, PRECISIONS)
    if c.precision == "fp16" and not torch.cuda.is_available():
        raise ConfigError("precision 'fp16' needs CUDA (its loss scale is for GPUs), and there is none here: use bf16")
    if c.optimizer_args is not None and not isinstance(c.optimizer_args, dict):
        raise ConfigError(f"optimizer_args {show(c.optimizer_args)}: must be a table of settings, like {{betas = [0.9, 0.95]}}")
    if c.lr is not None:
        c.lr = number("lr", c.lr, low=0.0, high=1000.0, low_open=True)
    if c.momentum is not None:
        c.momentum = number("momentum", c.momentum, low=0.0, high=1.0, high_open=True)
    if c.weight_decay is not None:
        c.weight_decay = number("weight_decay", c.weight_decay, low=0.0, high=1.0)
    if c.nesterov is not None and not isinstance(c.nesterov, bool):
        raise ConfigError(f"nesterov {show(c.nesterov)}: must be true or false")
    kwargs = optimizer_kwargs(c)
    defaults = optimizer_settings(c.optimizer)
    for name in ("lr", "momentum", "nesterov", "weight_decay"):
        if getattr(c, name) is None and name in defaults:
            setattr(c, name, kwargs.get(name, defaults[name]))
    try:
        OPTIMIZERS[c.optimizer]([torch.zeros(1)], **optimizer_kwargs(c))
    except ConfigError:
        raise
    except Exception as e:  # torch's own checks of the values (TypeError, ValueError, KeyError...)
        raise ConfigError(f"optimizer {c.optimizer}: {str(e).splitlines()[0][:200]}") from None
    if c.warmup is not None:
        c.warmup = parse_warmup(c.warmup)
    c.lr_gamma = number("lr_gamma", c.lr_gamma, low=0.0, high=1.0, low_open=True)
    c.lr_decay_epochs = number("lr_decay_epochs", c.lr_decay_epochs, low=0.0, high=1e6, low_open=True)
    c.accumulate = integer("accumulate", c.accumulate, low=1, high=1 << 20)
    c.num_workers = integer("num_workers", c.num_workers, low=0, high=256)


def _is_default(name: str, value, c: TrainConfig) -> bool:
    """Whether `value` is what option `name` is by default: the field's default, or what a
    strategy that takes the option makes of None (a run's config.toml records it resolved,
    e.g. micro_batch = batch_size // 4, so that file can be given to another strategy)."""
    if value == FIELDS[name].default:
        return True
    for option in (o for s in REGISTRY.values() for o in s.options if o.name == name):
        try:
            given = value if option.check is None else option.check(value, c)  # "2" from the CLI is 2
            if given == (option.default(c) if callable(option.default) else option.default):
                return True
        except (TypeError, ValueError, ConfigError):  # not this option's value; the config's other fields are checked later
            pass
    return False


def _validate_cluster(c: TrainConfig) -> None:
    """The strategy's own options (defaulted and checked as its registry entry says) and the
    stragglers."""
    for option in REGISTRY[c.strategy].options:
        setattr(c, option.name, option.resolve(c))
    texts = [c.straggler] if isinstance(c.straggler, str) else c.straggler
    if not isinstance(texts, (list, tuple)):
        raise ConfigError(f"straggler {show(c.straggler)}: must be a list of texts like 'rank=1,factor=3'")
    try:
        c.straggler = check_stragglers(texts, c.workers)
    except ClusterError as e:
        raise ConfigError(str(e)) from None


def _validate_simulation(c: TrainConfig, simulated: bool) -> None:
    """The simulate-only settings: rejected for `ako train`, checked for `ako simulate`; and
    the other way round for the train-only ones."""
    for name in TRAIN_OPTIONS if simulated else ():
        if getattr(c, name) is not None:
            raise ConfigError(f"{name} {show(getattr(c, name))}: only `ako train` takes it")
    if not simulated:
        if c.checkpoint_every is not None:
            c.checkpoint_every = str(c.checkpoint_every)
            parse_duration(c.checkpoint_every)
        if c.resume is not None and not isinstance(c.resume, str):
            raise ConfigError(f"resume {show(c.resume)}: must be a run directory")
        for name in SIMULATE_OPTIONS:
            if getattr(c, name) is not None:
                raise ConfigError(f"{name} {show(getattr(c, name))}: only `ako simulate` takes it")
        return
    if c.latency is not None:
        c.latency = str(c.latency)
        parse_latency(c.latency)
    if c.seconds_per_sample is not None:
        c.seconds_per_sample = number("seconds_per_sample", c.seconds_per_sample, low=0.0, high=SECONDS_PER_SAMPLE_MAX)
    if c.profile is not None and not isinstance(c.profile, str):
        raise ConfigError(f"profile {show(c.profile)}: must be a file path")


def to_toml(config: TrainConfig) -> str:
    """The resolved config as TOML text (fields that are None are left out)."""
    values = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()}
    return tomli_w.dumps({k: v for k, v in values.items() if v is not None and v != []})
