"""The Python API the CLI is a thin layer over.

    import ako
    result = ako.train(ako.TrainConfig(strategy="ako", workers=4, epochs=1))
    print(result.summary["test_accuracy"])

On one machine `train` starts `config.workers` processes; under `torchrun` (or any torch
elastic agent) the calling process is one worker, with the rank and world size the agent gives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ako.config import TrainConfig, validate
from ako.runtime.distributed import WorkerResult, run_worker
from ako.runtime.job import Job
from ako.runtime.launcher import launch, under_elastic_agent
from ako.strategies import Strategy


@dataclass
class RunResult:
    """`summary`: rank 0's run summary (None on other ranks under torchrun); `workers`: each
    surviving worker's final parameters and facts, by rank (servers left out; only this
    process's under torchrun)."""

    summary: dict | None
    workers: list[WorkerResult]


def train(
    config: TrainConfig,
    *,
    model_fn: Callable[[], nn.Module] | None = None,
    train_set: torch.utils.data.Dataset | None = None,
    test_set: torch.utils.data.Dataset | None = None,
    strategy: Strategy | None = None,
) -> RunResult:
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
        result = run_worker(job)
        return RunResult(result.summary, [result])
    job.check()
    results = launch(job, job.config.workers + (job.config.servers or 0))
    workers = [results[r] for r in sorted(results) if r < job.config.workers]
    return RunResult(results[0].summary, workers)
