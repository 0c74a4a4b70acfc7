"""The consensus measurement's exchange of replica copies within one process (`ako.run.consensus`)."""

from __future__ import annotations

import torch


class SharedReplicas:
    """`ReplicaExchange` within one process (the simulated runtime): worker `rank` puts its
    copies into `table` (point -> rank -> replica), which all `workers` workers share."""

    def __init__(self, table: dict[int, dict[int, torch.Tensor]], rank: int, workers: int):
        self.table, self.rank, self.peers = table, rank, range(1, workers)

    def report_replica(self, point: int, params: torch.Tensor) -> None:
        self.table.setdefault(point, {})[self.rank] = params.detach().clone()

    def peer_replicas(self, point: int, final: bool) -> list[torch.Tensor] | None:
        got = self.table.get(point, {})
        if not final and any(p not in got for p in self.peers):
            return None
        return [replica for _, replica in sorted(self.table.pop(point, {}).items())]
