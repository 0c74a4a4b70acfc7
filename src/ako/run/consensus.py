"""Consensus distance: how far apart the replicas are, where a strategy lets them differ
(Ako, gossip, EASGD).

How it is measured over time (`ReplicaExchange`: over the mailbox on real processes,
`runtime.distributed.replicas`; a shared table in the simulator). Evaluation point k is every worker's step
k x E (E = `eval_every` epochs in steps, the same on every worker: shards are equal), the
step at which rank 0 takes its evaluation snapshot. At that point every other worker hands
rank 0 a copy of its replica through the mailbox, on a runtime tag that does not count as
training traffic, with its clock paused for the copy (about a millisecond); it never waits for
anything. Where rank 0 evaluates only after training, the copies are held back until the
worker's training ends (`MailboxReplicas`), so that they do not share the links with training. Rank 0 files the copies. When it evaluates its snapshot of point k (after training,
or at once with a target accuracy), it also computes the consensus distance of the replicas
at point k and the test accuracy of their average, as soon as every live worker's copy of
point k is in: after training they all are; during training the record waits in line (clock
paused while it is computed) and metrics.jsonl gets it a few steps later. A worker that is
dead, or stopped before step k x E (`--max-time`), is left out of point k; the record says
how many replicas it holds. Replicas at one point are at the same step, not the same instant:
asynchronous workers reach it at different times.

At the end the workers' final replicas (which rank 0 receives anyway) give the last point;
there push-sum's replicas are averaged with their weights (`average_weight`), at evaluation
points with equal weights (the weights are the strategy's own).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


def consensus_distance(replicas: Sequence[torch.Tensor], weights: list[float] | None = None) -> tuple[float, torch.Tensor]:
    """Mean L2 distance of the replicas to their average, relative to the average's norm:
    (1/k) sum_i ||w_i - w_avg|| / ||w_avg||, with w_avg the mean of the replicas (weighted by
    `weights`, k floats > 0 in total, when given).

    replicas: k >= 1 tensors of shape (numel,) on one device (or a (k, numel) tensor). Returns
    (distance, a dimensionless float >= 0, NaN when the average is all zeros; w_avg (numel,),
    in the replicas' dtype). Computed in float64 one replica at a time (no (k, numel) float64
    copy: at 64 replicas of the cnn that copy cost more than the rest), so that identical
    replicas are at distance exactly 0. Raises ValueError when the weights sum to 0 or are not
    one per replica."""
    k = len(replicas)
    w = [1.0] * k if weights is None else [float(x) for x in weights]
    if len(w) != k:
        raise ValueError(f"weights {weights}: must be one per replica, {k}")
    total = sum(w)
    if not total > 0:
        raise ValueError(f"weights {weights}: must sum to more than 0")
    average = torch.zeros(replicas[0].shape, dtype=torch.float64, device=replicas[0].device)
    for wi, replica in zip(w, replicas):
        average.add_(replica, alpha=wi)
    average.div_(total)
    norm = torch.linalg.vector_norm(average).item()
    spread = sum(torch.linalg.vector_norm(torch.sub(replica, average)).item() for replica in replicas) / k
    return (spread / norm if norm > 0 else float("nan")), average.to(replicas[0].dtype)


class ReplicaExchange(Protocol):
    """What `WorkerState` needs from a runtime to measure consensus at evaluation points."""

    def report_replica(self, point: int, params: torch.Tensor) -> None:
        """A worker other than rank 0: hand rank 0 a copy of `params` at evaluation point `point`."""

    def peer_replicas(self, point: int, final: bool) -> list[torch.Tensor] | None:
        """Rank 0: the other workers' replicas at `point`, once every live worker's is in (or,
        when `final`, whatever came); None while some are missing."""
