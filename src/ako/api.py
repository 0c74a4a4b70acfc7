"""The Python API the CLI is a thin layer over.

    import ako
    result = ako.train(ako.TrainConfig(strategy="ako", workers=4, epochs=1))
    print(result.summary["test_accuracy"])

On one machine `train` starts `config.workers` processes; under `torchrun` (or any torch
elastic agent) the calling process is one worker, with the rank and world size the agent gives.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from ako.config import CUSTOM, FIELDS, ConfigError, TrainConfig, load_toml, run_config, validate
from ako.optim import OptimizerFn, SchedulerFn
from ako.replica import EvalFn, LossFn
from ako.run import lock
from ako.run.job import Job
from ako.run.outcome import MODEL_FILE, WorkerResult
from ako.run.preflight import check_free_space, check_out_dir
from ako.runtime.distributed import checkpoint
from ako.runtime.distributed.launcher import launch, under_elastic_agent
from ako.runtime.distributed.process import run_rank, workers_of
from ako.strategies import Strategy

ModelFn = Callable[[], nn.Module]  # a top-level function returning a fresh model
Dataset = torch.utils.data.Dataset | torch.utils.data.DataLoader


@dataclass
class RunResult:
    """`summary`: rank 0's run summary (None on other ranks under torchrun); `workers`: each
    surviving worker's final parameters and facts, by rank (servers left out; only this
    process's under torchrun)."""

    summary: dict | None
    workers: list[WorkerResult]

    @property
    def model(self) -> torch.Tensor | None:
        """The model the run hands back (the one in model.pt), flat (numel,): rank 0's final
        replica; under `easgd` the centre variable; where replicas differ (gossip) their
        average; under `ako` the better of the replicas after the flush and rank 0's replica
        before it (`summary["saved_model"]["source"]` says which). None where this process is
        not rank 0."""
        if self.summary is None or not self.workers or self.workers[0].rank != 0:
            return None
        return self.workers[0].model


def train(config: TrainConfig, *, model_fn: ModelFn | None = None, train_set: Dataset | None = None,
          test_set: Dataset | None = None, loss_fn: LossFn | None = None, eval_fn: EvalFn | None = None,
          optimizer_fn: OptimizerFn | None = None, scheduler_fn: SchedulerFn | None = None,
          collate_fn: Callable | None = None, strategy: Strategy | None = None, keep_saved: bool = True) -> RunResult:  # fmt: skip
    """Train data-parallel as `config` says and return the summary and final replicas.

    model_fn: a top-level function returning a fresh `nn.Module` (default: `config.model`).
    train_set/test_set: map-style data sets, or DataLoaders (their data set, collate
        function, batch size and num_workers are used; each worker still gets its own shard,
        reshuffled every epoch; a DataLoader with its own sampler is refused). Default:
        `config.dataset`.
    loss_fn(model, batch) -> scalar loss tensor; batch is what the collate function makes
        (default: mean cross-entropy of model(x) against y for (x, y) batches).
    eval_fn(model, batch) -> {metric: mean over the batch} (default: loss and accuracy);
        each metric is averaged over the test set and logged as test_<metric>, and
        `config.target` may name any of them.
    optimizer_fn(params) -> torch.optim.Optimizer, for a list of one flat tensor (numel,);
        scheduler_fn(optimizer) -> torch.optim.lr_scheduler.LRScheduler, stepped once per
        optimizer step (defaults: `config.optimizer`, `config.lr_schedule`).
    collate_fn(list of samples) -> batch (default: torch's default_collate).
    strategy: a custom `Strategy` (default: `config.strategy`).
    keep_saved: with `config.resume`, settings left at their defaults take the run's saved
        values (config.toml of that run directory).
    With several local processes these are pickled to each worker: give top-level functions,
    and guard a script that calls `train` with `if __name__ == "__main__":` (processes are
    spawned).

    Raises ConfigError or DataError (bad input, before any process starts) and WorkerFailed
    (a worker died or lost a peer; the message names the rank).
    """
    if keep_saved and config.resume is not None:
        config = with_saved(config)
    if under_elastic_agent():  # torchrun's world decides the number of workers
        config = replace(config, workers=workers_of(config))
    job = Job(validate(config), strategy, model_fn, train_set, test_set, loss_fn, eval_fn, optimizer_fn,
              scheduler_fn, collate_fn)  # fmt: skip
    local = 1 if under_elastic_agent() else job.config.workers + (job.config.servers or 0)
    data, replica = job.check(processes=local, out_dir=False)  # bad input fails here, before any process waits for another
    if under_elastic_agent():
        check_out_dir(job.config.out_dir)
        result = run_rank(job)
        return RunResult(result.summary, [result])
    _check_picklable(job)
    if job.config.resume is not None:
        lock.check_free(job.config.resume)
        checkpoint.check_unfinished(job.config)
        point = checkpoint.find(job.config.resume, job.identity(replica.numel, data.name), job.config.workers, buffers=replica.buffer_layout())
        checkpoint.check_ahead(job.config, point, len(data.train))
    check_free_space(job.config.resume or job.config.out_dir, replica)
    check_out_dir(job.config.out_dir)  # last: bad input makes no folder
    results = launch(job, job.config.workers + (job.config.servers or 0))
    workers = [results[r] for r in sorted(results) if r < job.config.workers]
    return RunResult(results[0].summary, workers)


def _check_picklable(job: Job) -> None:
    """Raise ConfigError (one line) for a user's function the spawned worker processes cannot
    get: a lambda, a nested function, an object that does not pickle."""
    for name in ("model_fn", "loss_fn", "eval_fn", "optimizer_fn", "scheduler_fn", "collate_fn"):
        fn = getattr(job, name)
        try:
            pickle.dumps(fn)
        except Exception as e:  # pickle raises PicklingError, AttributeError, TypeError...
            raise ConfigError(f"{name} {getattr(fn, '__qualname__', type(fn).__name__)!r}: the worker processes cannot get "
                              f"it ({type(e).__name__}); give a top-level function of a module, or a picklable object") from None


def with_saved(config: TrainConfig) -> TrainConfig:
    """`config` with every setting left at its default taken from `config.resume`'s saved
    config.toml (a resumed run keeps its settings unless told otherwise). Raises ConfigError
    when that directory holds no config.toml."""
    saved = load_toml(run_config(str(config.resume)))
    kept = {k: v for k, v in saved.items() if k != "resume" and v != CUSTOM and getattr(config, k) == FIELDS[k].default}
    return dataclasses.replace(config, **kept)


def load_model(run_dir: str | os.PathLike, model_fn: ModelFn | None = None) -> nn.Module:
    """The model a finished run handed back: its module (from `model_fn`, else the run's
    config.toml: a built-in model or `package.module:factory`) with the state_dict of
    `run_dir`/model.pt loaded, in eval mode. model.pt is a plain state_dict: without ako,
    `model.load_state_dict(torch.load(path))` does the same. Raises ConfigError when the run
    directory has no model.pt, it cannot be read, or the module does not match it."""
    run_dir = str(run_dir)
    path = os.path.join(run_dir, MODEL_FILE)
    run_config(run_dir, "run directory")
    if not os.path.isfile(path):
        raise ConfigError(f"run directory {run_dir!r}: no {MODEL_FILE} (the run did not finish)")
    try:
        model = _module_of(run_dir, model_fn)
        model.load_state_dict(torch.load(path, weights_only=True))
    except ConfigError:
        raise
    except Exception as e:  # a damaged file, a module that does not fit it, a factory that fails
        raise ConfigError(f"{path}: cannot load it into the model: {type(e).__name__}: "
                          f"{(str(e).strip().splitlines() or [''])[0][:200]}") from None  # fmt: skip
    return model.eval()


def _module_of(run_dir: str, model_fn: ModelFn | None) -> nn.Module:
    """The module a run directory's model.pt belongs to: `model_fn()`, else the run's model."""
    import json

    from ako.models import build_model, model_options
    from ako.run.imports import import_factory, is_spec

    settings = load_toml(os.path.join(run_dir, "config.toml"))
    name = settings.get("model", "cnn")
    if model_fn is not None:
        model = model_fn()
    elif is_spec(name):
        model = import_factory("model", name)()
    elif name == CUSTOM:
        raise ConfigError(f"run directory {run_dir!r}: its model was a model_fn of __main__: pass it as model_fn")
    else:
        with open(os.path.join(run_dir, "summary.json")) as f:
            saved = json.load(f)["saved_model"]
        model = build_model(name, tuple(saved["input_shape"]), saved["num_classes"], **model_options(name, settings))
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model of {run_dir!r}: the factory returned {type(model).__name__}, not an nn.Module")
    return model


def simulate(config: TrainConfig, *, model_fn: ModelFn | None = None, train_set: Dataset | None = None,
             test_set: Dataset | None = None, loss_fn: LossFn | None = None, eval_fn: EvalFn | None = None,
             optimizer_fn: OptimizerFn | None = None, scheduler_fn: SchedulerFn | None = None,
             collate_fn: Callable | None = None, strategy: Strategy | None = None) -> RunResult:  # fmt: skip
    """Run `config` on a simulated cluster in this process (docs/simulator.md):
    the same strategy programs with real gradients, time from the cost model.

    Costs: `config.bandwidth` is every node's up- and downlink rate (free when None),
    `config.latency` the per-message latency, and the compute speed is
    `config.seconds_per_sample`, else the `config.profile` file's (see `calibrate`), else
    measured here at the start (and recorded in the run's config.toml so it can be replayed).
    A profile with `shared_seconds_per_sample` (`ako calibrate --processes`) makes the cluster
    one host whose cores the workers share, as `ako train` runs them on the calibrating machine.
    Other arguments as for `train`. Returns the summary (times in virtual seconds) and every
    worker's final parameters. Raises ConfigError or DataError (bad input) and RuntimeError
    (the strategy deadlocked).
    """
    from ako.runtime.simulated.calibrate import load_profile, measure_seconds_per_sample
    from ako.runtime.simulated.costs import Costs
    from ako.runtime.simulated.simulate import simulate_job

    config = validate(config, simulated=True)
    job = Job(config, strategy, model_fn, train_set, test_set, loss_fn, eval_fn, optimizer_fn, scheduler_fn, collate_fn)
    data, replica = job.check(out_dir=False)
    sps, shared, ready = config.seconds_per_sample, (), ()
    if config.profile is not None:
        profile = load_profile(config.profile, config, data.name, tensors=len(replica.boundaries) - 1)
        sps = float(profile["seconds_per_sample"]) if sps is None else sps
        shared = tuple(float(t) for t in profile.get("shared_seconds_per_sample", ()))
        ready = tuple(float(f) for f in profile.get("gradient_ready", ()))
    check_free_space(config.out_dir, replica)
    check_out_dir(config.out_dir)  # after the profile's checks: bad input makes no folder
    if sps is None:
        sps = measure_seconds_per_sample(job, data, torch.device("cpu"))
    job.config = replace(config, seconds_per_sample=sps)
    bandwidth = config.bandwidth_bytes
    costs = Costs(sps, math.inf if bandwidth is None else bandwidth, config.latency_seconds, shared, ready)
    summary, workers = simulate_job(job, costs, data)
    return RunResult(summary, workers)


def calibrate(config: TrainConfig, out: str | None = None, processes: int = 1) -> dict:
    """Measure seconds per sample of `config.model` at `config.batch_size` on this machine (CPU,
    one thread; and the GPU where CUDA is present; with `processes` > 1 also 2..`processes`
    processes computing at once) and write the profile to `out` when given.
    Returns the profile dict. Raises ConfigError, DataError or RuntimeError."""
    from ako.runtime.simulated.calibrate import calibrate as measure

    if isinstance(processes, bool) or not isinstance(processes, int) or not 1 <= processes <= 256:
        raise ConfigError(f"processes {processes!r}: must be an integer from 1 to 256")
    return measure(validate(config, simulated=True), out, processes=processes)
