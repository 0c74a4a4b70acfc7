"""ako: data-parallel training without parameter-server bottlenecks (docs/design.md)."""

import os

# ako reports each failure in one line of its own: torch's C++ log (a TCPStore's retries print
# a stack trace each) only buries it. Read when torch is first imported; the user's setting
# wins, and AKO_DEBUG=1 keeps torch's log as well as the tracebacks.
if not os.environ.get("AKO_DEBUG"):
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

from ako.api import RunResult, calibrate, load_model, simulate, train
from ako.config import ConfigError, TrainConfig
from ako.data import DataError
from ako.runtime.distributed.launcher import WorkerFailed

__all__ = ["ConfigError", "DataError", "RunResult", "TrainConfig", "WorkerFailed", "calibrate", "load_model", "simulate", "train"]
