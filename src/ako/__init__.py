"""ako: data-parallel training without parameter-server bottlenecks (docs/design.md)."""

from ako.api import RunResult, calibrate, load_model, simulate, train
from ako.config import ConfigError, TrainConfig
from ako.data import DataError
from ako.runtime.distributed.launcher import WorkerFailed

__all__ = ["ConfigError", "DataError", "RunResult", "TrainConfig", "WorkerFailed", "calibrate", "load_model", "simulate", "train"]
