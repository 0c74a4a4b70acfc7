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

import tomli_w
import torch

from ako.cluster import ClusterError, check_stragglers
from ako.data.datasets import DATASETS
from ako.models import MODELS

PARAMETER_SERVER = ("bsp", "asp", "ssp", "absp", "easgd")
STRATEGIES = ("ako", "allreduce", "gossip", *PARAMETER_SERVER)
# settings that only some strategies use, with their defaults: setting one for another
# strategy is a mistake worth an error
STRATEGY_OPTIONS = {
    "partitions": ("auto", ("ako",)),
    "exchange": ("auto", ("ako",)),
    "staleness": (None, ("ako", "ssp")),
    "bandwidth": (None, ("ako", "easgd")),
    "servers": (None, PARAMETER_SERVER),
    "micro_batch": (None, ("absp",)),
    "tau": (None, ("easgd", "gossip")),
    "gossip": ("pull", ("gossip",)),
    "peers": ("random", ("gossip",)),
    "beta": (0.9, ("easgd",)),
}
# settings only the simulated runtime takes (`ako train` rejects them)
SIMULATE_OPTIONS = ("latency", "seconds_per_sample", "profile")
TRAIN_OPTIONS = ("checkpoint_every", "resume")  # `ako train` only: the simulator does not fail
SSP_STALENESS = 2  # ssp's bound when none is given
GOSSIP_MODES = ("pull", "push-sum")
AKO_EXCHANGES = ("auto", "all-to-all", "ring")
PEER_SELECTIONS = ("random", "rotating")
BACKENDS = ("auto", "gloo", "nccl")


class ConfigError(ValueError):
    """Bad configuration; the message is one line naming the value and what is allowed."""


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
    batch_size: int = 64  # per worker
    lr: float = 0.1  # learning rate of the averaged gradient, for every strategy
    momentum: float = 0.9
    nesterov: bool = True  # Nesterov momentum (when momentum > 0)
    weight_decay: float = 5e-4
    epochs: float = 2.0
    max_time: float | None = None  # seconds of training
    target_accuracy: float | None = None  # stop when rank 0's test accuracy reaches it
    eval_every: float = 0.5  # epochs between evaluations
    partitions: int | str = "auto"  # ako: p, or "auto"
    exchange: str = "auto"  # ako: how windows travel: "all-to-all", "ring", or "auto" (by the number of workers)
    staleness: int | None = None  # ako: bound s (0 = lock-step; default 1); ssp: s (default 2)
    bandwidth: str | None = None  # link budget, e.g. "1Gbit" or "50MB"; measured when None (simulate: every link's rate, free when None)
    servers: int | None = None  # parameter-server strategies: server processes (default 1)
    micro_batch: int | None = None  # absp: samples per interruptible micro-batch (default batch_size // 4)
    tau: int | str | None = None  # easgd: steps between elastic rounds, or "auto" (default); gossip: between gossip rounds (1)
    beta: float = 0.9  # easgd: moving rate; elastic alpha = beta / workers
    gossip: str = "pull"  # gossip: "pull" (average with a peer's snapshot) or "push-sum"
    peers: str = "random"  # gossip: peer selection, "random" or "rotating"
    straggler: tuple[str, ...] = ()  # e.g. ("rank=1,factor=3", "prob=0.1,factor=2"); see ako.cluster
    timeout: float = 60.0  # seconds any wait may take before the run fails
    seed: int = 0
    backend: str = "auto"
    out_dir: str = "runs"
    progress: bool | None = None  # progress bar: None = only on a terminal
    # `ako train` only (TRAIN_OPTIONS): checkpoints and resuming from them
    checkpoint_every: str | None = None  # e.g. "30s" or "5min"; None = no checkpoints
    resume: str | None = None  # a run directory to continue from its last complete checkpoint
    # `ako simulate` only (SIMULATE_OPTIONS): per-message latency, compute speed, cluster profile
    latency: str | None = None  # e.g. "100us"; None = 0
    seconds_per_sample: float | None = None  # forward+backward seconds per sample of one worker
    profile: str | None = None  # a cluster profile written by `ako calibrate`

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

    Returns seconds (>= 0). Raises ConfigError for anything else."""
    match = _LATENCY.match(str(text))
    if not match:
        raise ConfigError(f"latency {text!r}: expected a time like 100us, 0.5ms or 0.001s")
    value, unit = match.groups()
    return float(value) * _TIME_UNITS[unit or "s"]


def load_toml(path: str | os.PathLike) -> dict:
    """Read a config file into a dict of TrainConfig fields. Raises ConfigError on unknown keys,
    a missing file or TOML syntax errors."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(path)!r}: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r}: cannot read it ({e})") from None
    data = {key.replace("-", "_"): value for key, value in data.items()}
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise ConfigError(
            f"config file {str(path)!r}: unknown key {unknown[0]!r}; allowed: {', '.join(FIELDS)}"
        )
    return data


def validate(config: TrainConfig, simulated: bool = False) -> TrainConfig:
    """Check every field's type and range; return the config with values normalised
    (e.g. partitions "3" -> 3). `simulated`: for `ako simulate`, which takes SIMULATE_OPTIONS
    and a bandwidth (the link rate) for every strategy. Raises ConfigError naming the first
    bad value."""
    c = dataclasses.replace(config)
    _validate_simulation(c, simulated)
    for name in ("strategy", "dataset", "model", "backend", "out_dir"):
        if not isinstance(getattr(c, name), str) or not getattr(c, name):
            raise ConfigError(f"{name} {_show(getattr(c, name))}: must be a non-empty string")
    if c.data_dir is not None and not isinstance(c.data_dir, str):
        raise ConfigError(f"data_dir {_show(c.data_dir)}: must be a directory path")
    _choice("strategy", c.strategy, STRATEGIES)
    _choice("model", c.model, MODELS)
    _choice("data set", c.dataset, DATASETS)
    _choice("backend", c.backend, BACKENDS)
    _choice("gossip", c.gossip, GOSSIP_MODES)
    _choice("peers", c.peers, PEER_SELECTIONS)
    _choice("exchange", c.exchange, AKO_EXCHANGES)
    if c.backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("backend 'nccl' needs CUDA, and torch.cuda.is_available() is false here: use gloo")
    for name, (default, users) in STRATEGY_OPTIONS.items():
        if name == "bandwidth" and simulated:
            continue  # the simulator's link rate, for every strategy
        if c.strategy not in users and getattr(c, name) != default:
            raise ConfigError(
                f"{name} {_show(getattr(c, name))}: strategy {c.strategy} has no such option "
                f"(it is for {', '.join(users)})"
            )
    c.workers = _integer("workers", c.workers, low=1, high=4096)
    c.batch_size = _integer("batch_size", c.batch_size, low=1)
    c.seed = _integer("seed", c.seed, low=0, high=2**63 - 1)
    for name in ("train_samples", "test_samples"):
        if getattr(c, name) is not None:
            setattr(c, name, _integer(name, getattr(c, name), low=1))
    c.lr = _number("lr", c.lr, low=0.0, high=1000.0, low_open=True)
    c.momentum = _number("momentum", c.momentum, low=0.0, high=1.0, high_open=True)
    c.weight_decay = _number("weight_decay", c.weight_decay, low=0.0, high=1.0)
    c.epochs = _number("epochs", c.epochs, low=0.0, high=1e6, low_open=True)
    c.eval_every = _number("eval_every", c.eval_every, low=0.0, high=1e6, low_open=True)
    c.timeout = _number("timeout", c.timeout, low=1.0, high=86400.0)
    if c.max_time is not None:
        c.max_time = _number("max_time", c.max_time, low=0.0, high=1e9, low_open=True)
    if c.target_accuracy is not None:
        c.target_accuracy = _number("target_accuracy", c.target_accuracy, low=0.0, high=1.0, low_open=True)
    if c.staleness is not None:
        c.staleness = _integer("staleness", c.staleness, low=0, high=1000)
    if c.partitions != "auto":
        c.partitions = _integer("partitions", c.partitions, low=1, hint=" or 'auto'")
    if c.bandwidth is not None:
        c.bandwidth = str(c.bandwidth)
        parse_bandwidth(c.bandwidth)
    _validate_cluster(c)
    if not isinstance(c.nesterov, bool):
        raise ConfigError(f"nesterov {_show(c.nesterov)}: must be true or false")
    if c.progress is not None and not isinstance(c.progress, bool):
        raise ConfigError(f"progress {_show(c.progress)}: must be true or false")
    return c


def _validate_cluster(c: TrainConfig) -> None:
    """Servers, stragglers and the parameter-server strategies' own settings."""
    if c.strategy in PARAMETER_SERVER:
        c.servers = _integer("servers", 1 if c.servers is None else c.servers, low=1, high=1024)
    if c.strategy == "ssp" and c.staleness is None:
        c.staleness = SSP_STALENESS
    if c.strategy == "absp":
        default = max(1, c.batch_size // 4)
        c.micro_batch = _integer("micro_batch", default if c.micro_batch is None else c.micro_batch, low=1)
        if c.micro_batch > c.batch_size:
            raise ConfigError(f"micro_batch {c.micro_batch}: must be at most batch_size {c.batch_size}")
    if c.strategy == "easgd" and c.tau in (None, "auto"):
        c.tau = "auto"
    elif c.strategy in ("easgd", "gossip"):
        hint = " or 'auto'" if c.strategy == "easgd" else ""
        c.tau = _integer("tau", 1 if c.tau is None else c.tau, low=1, high=1_000_000, hint=hint)
    c.beta = _number("beta", c.beta, low=0.0, high=1.0)
    texts = [c.straggler] if isinstance(c.straggler, str) else c.straggler
    if not isinstance(texts, (list, tuple)):
        raise ConfigError(f"straggler {_show(c.straggler)}: must be a list of texts like 'rank=1,factor=3'")
    try:
        c.straggler = check_stragglers(texts, c.workers)
    except ClusterError as e:
        raise ConfigError(str(e)) from None


def _validate_simulation(c: TrainConfig, simulated: bool) -> None:
    """The simulate-only settings: rejected for `ako train`, checked for `ako simulate`; and
    the other way round for the train-only ones."""
    for name in TRAIN_OPTIONS if simulated else ():
        if getattr(c, name) is not None:
            raise ConfigError(f"{name} {_show(getattr(c, name))}: only `ako train` takes it")
    if not simulated:
        if c.checkpoint_every is not None:
            c.checkpoint_every = str(c.checkpoint_every)
            parse_duration(c.checkpoint_every)
        if c.resume is not None and not isinstance(c.resume, str):
            raise ConfigError(f"resume {_show(c.resume)}: must be a run directory")
        for name in SIMULATE_OPTIONS:
            if getattr(c, name) is not None:
                raise ConfigError(f"{name} {_show(getattr(c, name))}: only `ako simulate` takes it")
        return
    if c.latency is not None:
        c.latency = str(c.latency)
        parse_latency(c.latency)
    if c.seconds_per_sample is not None:
        c.seconds_per_sample = _number("seconds_per_sample", c.seconds_per_sample, low=0.0, high=1e3)
    if c.profile is not None and not isinstance(c.profile, str):
        raise ConfigError(f"profile {_show(c.profile)}: must be a file path")


def _choice(what: str, value: str, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"unknown {what} {value!r}: choose one of {', '.join(allowed)}")


def _show(value) -> str:
    """A value as the user wrote it: true/false for booleans, quoted strings."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


def _integer(name: str, value, low: int, high: int | None = None, hint: str = "") -> int:
    allowed = f"must be an integer >= {low}" + ("" if high is None else f" and <= {high}") + hint
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{name} {_show(value)}: {allowed}")
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{name} {_show(value)}: {allowed}") from None
    if number < low or (high is not None and number > high):
        raise ConfigError(f"{name} {_show(value)}: {allowed}")
    return number


def _number(name, value, low, high=math.inf, low_open=False, high_open=False) -> float:
    lo = f"> {low:g}" if low_open else f">= {low:g}"
    hi = "" if high == math.inf else (f" and < {high:g}" if high_open else f" and <= {high:g}")
    allowed = f"must be a number {lo}{hi}"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{name} {_show(value)}: {allowed}")
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"{name} {_show(value)}: {allowed}") from None
    below = number <= low if low_open else number < low
    above = number >= high if high_open else number > high
    if not math.isfinite(number) or below or above:
        raise ConfigError(f"{name} {_show(value)}: {allowed}")
    return number


def to_toml(config: TrainConfig) -> str:
    """The resolved config as TOML text (fields that are None are left out)."""
    values = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()}
    return tomli_w.dumps({k: v for k, v in values.items() if v is not None and v != []})
