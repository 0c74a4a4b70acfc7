"""The consensus measurement's exchange of replica copies over the mailbox (`ako.run.consensus`)."""

from __future__ import annotations

from collections import deque

import torch

from ako.runtime.distributed.mailbox import Mailbox
from ako.strategies.tags import REPLICA


class MailboxReplicas:
    """`ReplicaExchange` over the distributed runtime's mailbox (tag REPLICA, not training
    traffic); `workers` is the number of workers (ranks 0 .. workers-1).

    A worker other than rank 0 holds up to `hold` copies back and sends them when its training
    ends (`send_held`), the oldest first once more are held. Sent at each point, the copies
    share the links with training (n - 1 replicas into rank 0's downlink): at 100 Mbit/s with 4
    workers they took a fifth of Ako's samples/s. Rank 0 needs them only when it evaluates, so
    a run that evaluates after training holds as many as rank 0 keeps snapshots
    (`evaluation.snapshots_kept`); one with a target accuracy or checkpoints (rank 0 evaluates
    during training) holds none."""

    def __init__(self, mailbox: Mailbox, workers: int, hold: int = 0):
        self.mailbox, self.hold = mailbox, hold
        self.peers = list(range(1, workers))
        self.copies: dict[int, dict[int, torch.Tensor]] = {}  # point -> rank -> replica
        self.held: deque[tuple[int, torch.Tensor]] = deque()

    def report_replica(self, point: int, params: torch.Tensor) -> None:
        self.held.append((point, params.detach().to("cpu", copy=True)))
        while len(self.held) > self.hold:
            self._send(*self.held.popleft())

    def send_held(self) -> None:
        """Training ended: send the copies held back (before the final report, which rank 0
        waits for, so they are in when it does)."""
        while self.held:
            self._send(*self.held.popleft())

    def _send(self, point: int, copy: torch.Tensor) -> None:
        # a measurement never fails a run: if rank 0 is gone, the run fails elsewhere
        self.mailbox.send(copy, 0, REPLICA, step=point, drop_lost=True)

    def peer_replicas(self, point: int, final: bool) -> list[torch.Tensor] | None:
        for message in self.mailbox.poll(REPLICA, tolerant=True):
            self.copies.setdefault(message.step, {})[message.src] = message.tensor
        got = self.copies.get(point, {})
        missing = [p for p in self.peers if p not in got and p not in self.mailbox.lost]
        if missing and not final:
            return None
        return [replica for _, replica in sorted(self.copies.pop(point, {}).items())]
