"""The Python API the CLI is a thin layer over.

    import ako
    result = ako.train(ako.TrainConfig(strategy="ako", workers=4, epochs=1))
    print(result.summary["test_accuracy"])

On one machine `train` starts `config.workers` processes; under `torchrun` (or any torch
elastic agent) the calling process is one worker, with the rank and world size the agent gives.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from ako.config import ConfigError, TrainConfig, validate
from ako.run.job import Job
from ako.run.outcome import WorkerResult
from ako.runtime.distributed import checkpoint
from ako.runtime.distributed.launcher import launch, under_elastic_agent
from ako.runtime.distributed.process import run_rank
from ako.strategies import Strategy

ModelFn = Callable[[], nn.Module]  # a top-level function returning a fresh model
Dataset = torch.utils.data.Dataset


@dataclass
class RunResult:
    """`summary`: rank 0's run summary (None on other ranks under torchrun); `workers`: each
    surviving worker's final parameters and facts, by rank (servers left out; only this
    process's under torchrun)."""

    summary: dict | None
    workers: list[WorkerResult]

    @property
    def model(self) -> torch.Tensor | None:
        """The model the run hands back, flat (numel,): rank 0's final replica; under `easgd`
        the centre variable; under `ako` the better of the replicas after the flush and rank 0's
        replica before it (`summary["final_model"]` says which). None where this process is
        not rank 0."""
        if self.summary is None or not self.workers or self.workers[0].rank != 0:
            return None
        facts = self.workers[0].facts
        if self.summary.get("final_model", {}).get("source") == "rank 0's replica before the flush":
            return torch.as_tensor(facts["unflushed"])
        if facts.get("centre") is not None:
            return torch.as_tensor(facts["centre"])
        return self.workers[0].params


def train(config: TrainConfig, *, model_fn: ModelFn | None = None, train_set: Dataset | None = None,
          test_set: Dataset | None = None, strategy: Strategy | None = None) -> RunResult:  # fmt: skip
    """Train data-parallel as `config` says and return the summary and final replicas.

    model_fn: a top-level function returning a fresh `nn.Module` (default: `config.model` from
        the registry). train_set/test_set: map-style data sets of (x, label) pairs (default:
        `config.dataset`). strategy: a custom `Strategy` (default: `config.strategy`). With
        several local processes these are pickled to each worker, and a script that calls
        `train` needs an `if __name__ == "__main__":` guard (processes are spawned).

    Raises ConfigError or DataError (bad input, before any process starts) and WorkerFailed
    (a worker died or lost a peer; the message names the rank).
    """
    job = Job(validate(config), strategy, model_fn, train_set, test_set)
    if under_elastic_agent():
        result = run_rank(job)
        return RunResult(result.summary, [result])
    _, numel = job.check()
    if job.config.resume is not None:
        checkpoint.find(job.config.resume, job.identity(numel), job.config.workers)
    results = launch(job, job.config.workers + (job.config.servers or 0))
    workers = [results[r] for r in sorted(results) if r < job.config.workers]
    return RunResult(results[0].summary, workers)


def simulate(config: TrainConfig, *, model_fn: ModelFn | None = None, train_set: Dataset | None = None,
             test_set: Dataset | None = None, strategy: Strategy | None = None) -> RunResult:  # fmt: skip
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
    job = Job(config, strategy, model_fn, train_set, test_set)
    data, _ = job.check()
    sps, shared = config.seconds_per_sample, ()
    if config.profile is not None:
        profile = load_profile(config.profile, config, data.name)
        sps = float(profile["seconds_per_sample"]) if sps is None else sps
        shared = tuple(float(t) for t in profile.get("shared_seconds_per_sample", ()))
    if sps is None:
        sps = measure_seconds_per_sample(job, data, torch.device("cpu"))
    job.config = replace(config, seconds_per_sample=sps)
    bandwidth = config.bandwidth_bytes
    costs = Costs(sps, math.inf if bandwidth is None else bandwidth, config.latency_seconds, shared)
    summary, workers = simulate_job(job, costs)
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
