"""Rank 0's evaluations: snapshots of its replica at evaluation points, evaluated on the test
set (at once with a target, else after training), logged in order to metrics.jsonl,
with the consensus distance of the replicas where they differ (`ako.run.consensus`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ako.metrics import MetricsLog
from ako.replica import Replica
from ako.run.consensus import ReplicaExchange, consensus_distance

_SNAPSHOT_BYTES = 256 << 20  # snapshots (and the peers' copies for them) kept before evaluating


def snapshots_kept(copies: int, replica_bytes: int) -> int:
    """How many evaluation points rank 0 keeps before it evaluates during training: as many as
    fit 256 MB with `copies` replicas of `replica_bytes` each a point (its own and the other
    workers' copies). The other workers hold back as many of their copies (`MailboxReplicas`)."""
    return _SNAPSHOT_BYTES // (copies * replica_bytes)


@dataclass
class _Snapshot:
    """Rank 0's replica (numel,) at evaluation point `point` (None: the end of training) and
    its record, until it is logged; `metrics` once evaluated; `extra` fields for the record
    known beforehand (the end's consensus)."""

    record: dict
    params: torch.Tensor
    point: int | None
    metrics: dict | None = None
    extra: dict = field(default_factory=dict)


class Evaluator:
    """Rank 0's evaluations of `replica` on `test_set`, into `log`. With `consensus`, each
    record waits for the other `world_size - 1` workers' copies of their replicas at the same
    point and adds their consensus distance and the accuracy of their average. With `eager`
    (a target accuracy), every snapshot is evaluated at once."""

    def __init__(self, replica: Replica, test_set, log: MetricsLog, world_size: int,
                 consensus: ReplicaExchange | None = None, eager: bool = False):  # fmt: skip
        self.replica, self.test_set, self.log, self.world_size = replica, test_set, log, world_size
        self.consensus, self.eager = consensus, eager
        self.snapshots: list[_Snapshot] = []  # awaiting evaluation or logging, oldest first
        self.tick: Callable[[], None] = lambda: None  # called after each evaluation of the test set

    def pending(self) -> int:
        """How many evaluations of the test set the snapshots kept still need: their own, and
        their replicas' average where replicas differ."""
        averages = sum(s.point is not None for s in self.snapshots) if self.consensus is not None else 0
        return sum(s.metrics is None for s in self.snapshots) + averages

    def measure(self, params: torch.Tensor) -> dict:
        """The replica's metrics on the test set with `params` (numel,) in place of its own;
        `tick` counts it."""
        metrics = self.replica.evaluate_params(params.to(self.replica.params.device), self.test_set)
        self.tick()
        return metrics

    def keep(self, record: dict, point: int | None, extra: dict | None = None) -> bool:
        """Keep a copy of the replica with its progress `record` at evaluation point `point`
        (None: the end). Returns whether to evaluate now: when eager, or when what is kept (and
        the peers' copies for it) would pass 256 MB."""
        self.snapshots.append(_Snapshot(record, self.replica.params.clone(), point, extra=extra or {}))
        copies = self.world_size if self.consensus is not None else 1
        return self.eager or len(self.snapshots) > snapshots_kept(copies, self.replica.grad_bytes)

    @property
    def evaluated_first(self) -> bool:
        """Whether the oldest snapshot is evaluated and only waits for the peers' copies."""
        return bool(self.snapshots) and self.snapshots[0].metrics is not None

    def evaluate(self, final: bool = False, each: bool = False) -> dict:
        """Evaluate the snapshots not yet evaluated and log, oldest first, those whose
        consensus is known (all of them when `final`; with `each`, after every evaluation, so
        that a process stopped midway has logged what it did); returns the last one's metrics
        (the replica's `eval_fn`'s: loss and accuracy by default), each as test_<metric>."""
        metrics = {}
        for s in list(self.snapshots):
            if s.metrics is None:
                s.metrics = self.measure(s.params)
                s.record.update(prefixed("test", s.metrics))
                if each:
                    self.log_ready(final)
            metrics = s.metrics
        self.log_ready(final)
        return metrics

    def log_ready(self, final: bool) -> None:
        """Log the evaluated snapshots at the head of the line whose point every live worker
        has reported (when `final`, with whatever was reported)."""
        while self.evaluated_first:
            s = self.snapshots[0]
            if self.consensus is not None and s.point is not None:
                others = self.consensus.peer_replicas(s.point, final)
                if others is None:
                    return
                s.record.update(self.consensus_record([s.params, *others]))
            self.log.append({**s.record, **s.extra})
            self.snapshots.pop(0)

    def consensus_record(self, replicas: list[torch.Tensor], weights: list[float] | None = None) -> dict:
        """How many replicas, their consensus distance, and the test loss and accuracy of their
        (weighted) average: the fields the records add where replicas differ."""
        distance, average = consensus_distance([r.to(self.replica.params.device) for r in replicas], weights)
        metrics = self.measure(average)
        return {"replicas": len(replicas), "consensus_distance": float(f"{distance:.4g}"), **prefixed("average", metrics)}


def prefixed(prefix: str, metrics: dict) -> dict:
    """`metrics` as record fields: {"loss": 0.31} -> {"test_loss": 0.31}, to 5 decimals."""
    return {f"{prefix}_{name}": round(float(value), 5) for name, value in metrics.items()}
