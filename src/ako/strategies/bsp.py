"""BSP and SSP parameter servers (Valiant 1990; Ho et al., NIPS 2013, "More effective distributed
ML via a stale synchronous parallel parameter server").

Workers run `paramserver.gradient_worker`: compute, push, pull. Each worker has a clock (its
pushes so far). The server applies the gradients a clock at a time: when every worker still
running has pushed clock c, it applies their mean as one optimizer step, so momentum sees one
update per clock and s = 0 is exactly BSP (and BSP is all-reduce SGD with the update done on
the servers). A worker that has pushed clock c may start c + 1 only when the slowest worker
still running has pushed clock c - s (SSP's bound; `bsp` is s = 0). It then pulls the
parameters of every complete clock: at least clocks <= c - s, the SSP guarantee.

Stopping: with s = 0 a worker finishes at the clock where any worker voted to stop, so all
finish together; with s > 0 each finishes on its own vote, and stops counting towards the
bound. A finishing worker gets the parameters once its last clock has been applied.
Staleness of a gradient: clocks applied between the version it was computed on and its own.
"""

from __future__ import annotations

import torch

from ako.strategies.ops import Recv
from ako.strategies.paramserver import PUSH, Shard, unpack


def bsp_server(sctx):
    """BSP server program: SSP with s = 0."""
    return (yield from ssp_server(sctx, staleness=0))


def ssp_server(sctx, staleness: int | None = None):
    """SSP server program with bound `staleness` (default: the config's)."""
    s = sctx.config.staleness if staleness is None else staleness
    shard = Shard(sctx)
    clocks = Clocks(sctx.workers, shard)
    while clocks.running or clocks.held:
        m = yield Recv(PUSH)
        vote, version = unpack(m.aux, 1, 40)
        clocks.pushed(m.src, m.step, m.tensor, version, bool(vote), lock_step=s == 0)
        clocks.apply_complete()
        for worker, finish in clocks.releasable(s):
            yield from shard.reply(worker, finish)
    return shard.facts()


class Clocks:
    """The server's view of the workers' clocks: gradients summed per clock, the replies held
    back, and the clock at which each worker finished."""

    def __init__(self, workers: list[int], shard: Shard):
        self.shard = shard
        self.clock = {w: 0 for w in workers}  # clocks pushed
        self.last: dict[int, int] = {}  # worker -> its final clock
        self.held: dict[int, int] = {}  # worker -> the clock it pushed, awaiting its reply
        self.sums: dict[int, list] = {}  # clock -> [gradient sum, count, versions, any vote]
        self.applied = 0  # complete clocks applied

    @property
    def running(self) -> list[int]:
        return [w for w in self.clock if w not in self.last]

    def pushed(self, worker: int, c: int, grad: torch.Tensor, version: int, vote: bool, lock_step: bool) -> None:
        entry = self.sums.setdefault(c, [torch.zeros_like(grad), 0, [], False])
        entry[0].add_(grad)
        entry[1] += 1
        entry[2].append(version)
        entry[3] |= vote
        self.clock[worker] = c + 1
        self.held[worker] = c
        if vote and not lock_step:
            self.last[worker] = c
        if lock_step and entry[3] and entry[1] == self._expected(c):
            for w in self.clock:  # everyone finishes at the clock where anyone voted
                self.last.setdefault(w, c)

    def _expected(self, c: int) -> int:
        return sum(1 for w in self.clock if self.last.get(w, c) >= c)

    def apply_complete(self) -> None:
        """Apply, in order, every clock that all its workers have pushed: their mean gradient."""
        while self.applied in self.sums and self.sums[self.applied][1] == self._expected(self.applied):
            total, count, versions, _ = self.sums.pop(self.applied)
            for v in versions:
                self.shard.seen(self.applied - v)
            self.shard.apply(total.div_(count))
            self.applied += 1

    def releasable(self, s: int) -> list[tuple[int, bool]]:
        """The held workers that may go on now, with whether each must finish: a running one
        when the slowest running worker has pushed clock >= its clock - s; a finishing one when
        its last clock is applied."""
        slowest = min((self.clock[w] for w in self.running), default=None)
        out = []
        for worker, c in list(self.held.items()):
            finish = worker in self.last
            ready = self.applied > c if finish else slowest is not None and slowest >= c + 1 - s and self.applied >= c + 1 - s
            if ready:
                del self.held[worker]
                out.append((worker, finish))
        return out
