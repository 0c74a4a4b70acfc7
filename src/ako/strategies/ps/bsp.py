"""BSP parameter server (Valiant 1990, as parameter servers run it): the server waits for all n
gradients of iteration t, applies their mean as one optimizer step and releases iteration t + 1.

Workers run `workers.gradient_worker`: compute, push, pull. The n pushes a server receives
between two releases are exactly one per worker, since no worker can push twice without a
reply. A worker finishes at the iteration where any worker voted to stop, so all finish
together, with the same parameters. BSP is all-reduce SGD with the update done on the servers.
"""

from __future__ import annotations

import torch

from ako.strategies.base import Strategy
from ako.strategies.ops import Recv
from ako.strategies.ps.shard import SERVERS, Shard, check, staleness_summary, unpack
from ako.strategies.ps.workers import gradient_worker
from ako.strategies.tags import PS_PUSH


def server(sctx):
    """BSP server program."""
    shard = Shard(sctx)
    while True:
        total, finish, waiting = torch.zeros_like(shard.params), False, frozenset(sctx.workers)
        while waiting:
            m = yield Recv(PS_PUSH, awaiting=waiting)
            waiting -= {m.src}
            vote, version = unpack(m.aux, 1, 40)
            total.add_(m.tensor)
            finish |= bool(vote)
            shard.seen(version)
        shard.apply(total.div_(len(sctx.workers)))
        for worker in sctx.workers:
            yield from shard.reply(worker, finish)
        if finish:
            return shard.facts()


STRATEGY = Strategy(
    name="bsp", worker=gradient_worker, server=server, options=(SERVERS,), check=check, summarise=staleness_summary, lockstep=True,
    paper="bulk synchronous parallel on parameter servers (Valiant 1990)", optimizer_on="servers",
)
