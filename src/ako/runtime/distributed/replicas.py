"""The consensus measurement's exchange of replica copies over the mailbox (`ako.run.consensus`)."""

from __future__ import annotations

import torch

from ako.runtime.distributed.mailbox import Mailbox
from ako.strategies.tags import REPLICA


class MailboxReplicas:
    """`ReplicaExchange` over the distributed runtime's mailbox (tag REPLICA, not training
    traffic); `workers` is the number of workers (ranks 0 .. workers-1)."""

    def __init__(self, mailbox: Mailbox, workers: int):
        self.mailbox = mailbox
        self.peers = list(range(1, workers))
        self.copies: dict[int, dict[int, torch.Tensor]] = {}  # point -> rank -> replica

    def report_replica(self, point: int, params: torch.Tensor) -> None:
        # a measurement never fails a run: if rank 0 is gone, the run fails elsewhere
        self.mailbox.send(params.detach().to("cpu", copy=True), 0, REPLICA, step=point, drop_lost=True)

    def peer_replicas(self, point: int, final: bool) -> list[torch.Tensor] | None:
        for message in self.mailbox.poll(REPLICA, tolerant=True):
            self.copies.setdefault(message.step, {})[message.src] = message.tensor
        got = self.copies.get(point, {})
        missing = [p for p in self.peers if p not in got and p not in self.mailbox.lost]
        if missing and not final:
            return None
        return [replica for _, replica in sorted(self.copies.pop(point, {}).items())]
