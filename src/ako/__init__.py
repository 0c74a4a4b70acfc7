"""ako: data-parallel training without parameter-server bottlenecks (docs/design.md).

The names below are imported on first use, not with the package: `ako.cli` holds Ctrl-C
while torch loads, which it can only do if importing the package itself does not load it."""

import importlib
import os

# ako reports each failure in one line of its own: torch's C++ log (a TCPStore's retries print
# a stack trace each) only buries it. Read when torch is first imported; the user's setting
# wins, and AKO_DEBUG=1 keeps torch's log as well as the tracebacks.
if not os.environ.get("AKO_DEBUG"):
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

_WHERE = {
    "ConfigError": "ako.config", "TrainConfig": "ako.config", "DataError": "ako.data",
    "RunResult": "ako.api", "calibrate": "ako.api", "load_model": "ako.api", "simulate": "ako.api", "train": "ako.api",
    "WorkerFailed": "ako.runtime.distributed.launcher", "finish": "ako.loop", "shard": "ako.loop", "wrap": "ako.loop",
    "state_dict": "ako.loop", "load_state_dict": "ako.loop",
}  # fmt: skip
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'ako' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
