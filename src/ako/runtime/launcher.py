"""Start the workers of a job on this machine with torch's elastic launch machinery (what
torchrun uses), and turn a failed worker into one line naming its rank and exit status."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ako.config import ConfigError
from ako.data import DataError
from ako.runtime.distributed import WorkerResult, run_worker
from ako.runtime.job import Job
from ako.strategies.ops import PeerLost

# Failures a worker reports in one line; anything else is a bug and keeps its traceback.
EXPECTED_FAILURES = (PeerLost, TimeoutError, DataError, ConfigError, dist.DistError, RuntimeError, OSError)


class WorkerFailed(RuntimeError):
    """A worker process failed; the message names its rank and exit status."""


def under_elastic_agent() -> bool:
    """True inside a process started by torchrun (or torch's elastic agent)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def worker_entry(job: Job) -> WorkerResult:
    """The function each launched process runs: a one-line report and exit status 1 on an
    expected failure (set AKO_DEBUG=1 for the traceback), 130 on Ctrl-C."""
    try:
        return _numpy(run_worker(job))
    except KeyboardInterrupt:  # the agent reports it once, for every worker
        _exit_now(130)
    except EXPECTED_FAILURES as e:
        if os.environ.get("AKO_DEBUG"):
            raise
        print(f"ako: worker rank {os.environ.get('RANK', '?')}: {one_line(e)}", file=sys.stderr)
        # Often this worker only noticed another's death: give the agent a moment to see that
        # one first, so that its report names the root cause.
        time.sleep(1.0)
        _exit_now(1)


def _numpy(result: WorkerResult) -> WorkerResult:
    """Tensors travel to the launcher as NumPy arrays, by value: torch would share their memory
    through file descriptors, which are gone if the worker dies before the launcher reads them."""
    return _convert(result, torch.Tensor, torch.Tensor.numpy)


def _torch(result: WorkerResult) -> WorkerResult:
    return _convert(result, np.ndarray, torch.from_numpy)


def _convert(result: WorkerResult, kind: type, convert) -> WorkerResult:
    def one(value):
        return convert(value) if isinstance(value, kind) else value

    return replace(result, params=one(result.params), facts={k: one(v) for k, v in result.facts.items()})


def _exit_now(status: int) -> None:
    """Exit without interpreter teardown: receive threads may still be blocked in a Gloo recv
    from a dead peer, and tearing down under them aborts the process."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def launch(job: Job, workers: int) -> dict[int, WorkerResult]:
    """Run `job` on `workers` local processes; returns each rank's result.

    Raises WorkerFailed as soon as any worker fails (the others are stopped by the agent).
    """
    results = launch_function(worker_entry, workers, job, timeout=job.config.timeout)
    return {rank: _torch(result) for rank, result in results.items()}


def launch_function(fn, processes: int, *args, timeout: float = 60.0) -> dict:
    """Run `fn(*args)` in `processes` spawned processes under torch's elastic agent, as torchrun
    would (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set); returns {rank: fn's result}.
    `fn` must be importable (spawned processes unpickle it). Raises WorkerFailed."""
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=processes,
        run_id=f"ako-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        rdzv_configs={"timeout": int(max(30, timeout))},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        shutdown_timeout=5,  # seconds from SIGTERM to SIGKILL for workers that outlive a failure
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d's socket warnings; ako reports failures itself
    with _quiet_agent():
        try:
            return elastic_launch(config, fn)(*args)
        except ChildFailedError as e:
            raise WorkerFailed(describe_failures(e)) from None
        except SignalException as e:  # the agent stopped the workers on SIGINT or SIGTERM
            raise KeyboardInterrupt(str(e)) from None


def describe_failures(error: ChildFailedError) -> str:
    """One line: which rank failed first and how, and which others failed after it."""
    first_rank, first = error.get_first_failure()
    text = f"worker rank {first_rank} failed: {_exit_status(first.exitcode)}"
    others = sorted(r for r in error.failures if r != first_rank)
    if others:
        text += f"; then rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} stopped"
    return text


def _exit_status(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def one_line(e: BaseException) -> str:
    """The first line of an error's message, at most 300 characters."""
    lines = str(e).strip().splitlines()
    return (lines[0] if lines else type(e).__name__)[:300]


@contextmanager
def _quiet_agent():
    """The elastic agent logs each failure with a traceback of its own; ako reports it in one
    line. torch gives each of its modules' loggers a level of its own, so set them all."""
    prefixes = ("torch.distributed.elastic", "torch.multiprocessing", "torch.distributed.launcher", "torchelastic")
    import torch.distributed.elastic.agent.server.api  # noqa: F401  (creates its logger now)

    loggers = [
        logging.getLogger(name) for name in list(logging.root.manager.loggerDict) if name.startswith(prefixes)
    ]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
