"""The checks of a job before any process starts: its data, model, training step, evaluation,
optimizer and schedule are tried on a few samples and a probe vector, so that what does not fit
fails once, in one line (ConfigError, exit status 2), and not in every worker."""

from __future__ import annotations

import importlib
import numbers
import os
from pathlib import Path

import torch

from ako.config import ConfigError
from ako.data import fetch
from ako.optim import check_elementwise
from ako.replica import Replica
from ako.run.imports import first_line


def check(job, processes: int = 1, out_dir: bool = True) -> tuple:
    """Load `job`'s data, build its model and replica, and try them (`Job.check`), that
    `processes` processes started here fit in memory (`check_memory`), and, with `out_dir`,
    make the output folder (`check_out_dir`; else the caller does, after its own checks):
    returns (data, the replica tried: its `numel` and `buffer_layout` are the model's)."""
    data = job.load_data()
    model = job.build_model(data)
    try:
        replica = Replica(model, job.optimization(data), job.loss_fn, job.eval_fn, data.collate_fn, job.config.precision)
    except ConfigError:
        raise
    except Exception as e:  # the optimizer or schedule (the user's, or a setting torch refuses)
        raise ConfigError(f"{_optimizer_what(job)} failed: {type(e).__name__}: {first_line(e)}") from None
    job.validate(data, replica)
    _try_step(job, replica, data)
    _try_optimizer(job, data)
    if job.config.tensorboard:
        _check_tensorboard()
    if processes > 1:
        servers = processes - job.config.workers
        check_memory(processes, _process_bytes(data, replica), f"workers {job.config.workers}" + (f" + servers {servers}" if servers else ""))
    if out_dir:
        check_out_dir(job.config.out_dir)
    return data, replica


TORCH_PROCESS_BYTES = 250 * 2**20  # a worker process with torch imported, before data (measured here: 260 MiB with digits)


def _process_bytes(data, replica: Replica) -> int:
    """A lower bound of one worker process's memory: torch, the data sets' tensors (where they
    are `TensorDataset`s: Fashion-MNIST's are 220 MB) and the replica's parameters, gradient
    and two optimizer buffers."""
    held = sum(t.nbytes for split in (data.train, data.test) for t in getattr(split, "tensors", ()) if isinstance(t, torch.Tensor))
    return TORCH_PROCESS_BYTES + held + 4 * replica.params.nbytes


def check_memory(processes: int, each: int, what: str) -> None:
    """Raise ConfigError when `processes` local processes of `each` bytes (`what`: "workers 2
    + servers 100") would not fit in the memory available here (Linux's MemAvailable; elsewhere
    nothing is checked). Past that the machine swaps or kills, and the start-up waits cannot
    tell a slow start from a dead one."""
    try:
        available = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                         if line.startswith("MemAvailable:"))  # fmt: skip
    except (OSError, StopIteration, ValueError, IndexError):
        return
    if processes * each > available:
        raise ConfigError(
            f"{what}: {processes} processes of at least {each / 2**20:.0f} MiB each (torch, the data and the model) need "
            f"{processes * each / 2**30:.1f} GiB, more than the {available / 2**30:.1f} GiB of memory available here; "
            "start fewer, or simulate the cluster with ako simulate, or spread it over machines with torchrun"
        )


def _optimizer_what(job) -> str:
    if job.optimizer_fn is not None or job.scheduler_fn is not None:
        return " or ".join(n for n in ("optimizer_fn", "scheduler_fn") if getattr(job, n) is not None)
    return f"optimizer {job.config.optimizer}"


def _try_optimizer(job, data) -> None:
    """Three steps of the optimizer and schedule on a probe vector: on two halves against the
    whole vector where servers step shards (`check_elementwise`), else on the whole."""
    if job.strategy.optimizer_on == "servers":
        check_elementwise(job.optimization(data), job.strategy.name)
        return
    try:
        optimizer = job.optimization(data).build(torch.zeros(8))
        for k in range(3):
            optimizer.step(torch.full((8,), 0.1 * (k + 1)))
    except Exception as e:  # the user's functions, or a setting only a step finds
        raise ConfigError(f"{_optimizer_what(job)}: a step failed: {type(e).__name__}: {first_line(e)}") from None


def _try_step(job, replica: Replica, data) -> None:
    """The loss on two training samples and the evaluation on two test samples."""
    what = "the training set or collate_fn"
    try:
        batch = fetch(data.train, torch.arange(min(2, len(data.train))), data.collate_fn)
        what = "loss_fn" if job.loss_fn is not None else f"model {job.model_name!r}"
        replica.compute_gradient([batch])
        what = "the test set or collate_fn"
        test = fetch(data.test, torch.arange(min(2, len(data.test))), data.collate_fn)
        what = "eval_fn" if job.eval_fn is not None else f"model {job.model_name!r}"
        with torch.no_grad():
            metrics = replica.eval_fn(replica.model.eval(), test)
    except Exception as e:  # the user's code: any error, said in one line
        raise ConfigError(f"{what} failed on a batch of two samples: {type(e).__name__}: {first_line(e)}") from None
    _check_metrics(metrics, job.config.goal)


def _check_metrics(metrics, goal) -> None:
    """An evaluation is a non-empty dict of name -> real number (a Python or NumPy one, or a
    one-element tensor), with the target's metric."""
    if not isinstance(metrics, dict) or not metrics:
        raise ConfigError(f"eval_fn: must return a non-empty dict of metric name -> number, got {metrics!r:.80}")
    for name, value in metrics.items():
        number = isinstance(value, numbers.Real) or (isinstance(value, torch.Tensor) and value.numel() == 1)  # NumPy's too
        if not isinstance(name, str) or not number or isinstance(value, bool) or torch.is_complex(torch.as_tensor(value)):
            raise ConfigError(f"eval_fn: metric {name!r} = {value!r:.60}: each must be named by a string and be a real number")
    if goal is not None and goal.metric not in metrics:
        raise ConfigError(f"target {str(goal)!r}: the evaluation has no metric {goal.metric!r} "
                          f"(it gives {', '.join(metrics)})")  # fmt: skip


def _check_tensorboard() -> None:
    try:
        importlib.import_module("torch.utils.tensorboard")  # the writer needs the tensorboard package
    except ImportError:
        raise ConfigError("tensorboard: the tensorboard package is not installed (pip install tensorboard)") from None


def check_out_dir(out_dir: str) -> None:
    """Make `out_dir` (the last check before a run starts); raise ConfigError if it cannot be
    made (the parents it made are removed again) or written to."""
    path = Path(out_dir)
    missing = [p for p in (path, *path.parents) if not os.path.exists(p)]  # (an over-long name is not)  # what mkdir makes, deepest first
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        for made in (p for p in missing if os.path.isdir(p)):  # bad input leaves nothing behind
            try:
                made.rmdir()
            except OSError:
                break  # not empty (another process's?) or not ours to remove
        raise ConfigError(f"out_dir {out_dir!r}: cannot make it ({e.strerror})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"out_dir {out_dir!r}: not writable")


def check_free_space(where: str | os.PathLike, replica: Replica) -> None:
    """Raise ConfigError when the file system that `where` (a run's out_dir or the run
    directory it resumes; its nearest existing folder) is on has less room than model.pt
    alone takes (the model's parameters and buffers, in bytes): plainly too small for the run's
    files. A fuller check would guess at checkpoints and logs; this one never refuses a run
    that could finish."""
    path = Path(where).absolute()
    while not os.path.exists(path) and path != path.parent:
        path = path.parent
    try:
        stats = os.statvfs(path)
    except (OSError, AttributeError):  # no statvfs (Windows), a folder it may not read: the writes will say
        return
    free = stats.f_bavail * stats.f_frsize
    need = sum(t.nbytes for t in replica.model.state_dict().values())
    if free < need:
        raise ConfigError(f"out_dir {str(where)!r}: {free / 1e3:.0f} KB free on its file system ({path}), and model.pt alone "
                          f"takes {need / 1e3:.0f} KB; free space there or give another --out-dir")  # fmt: skip

