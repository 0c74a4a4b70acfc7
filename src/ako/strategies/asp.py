"""ASP parameter server: asynchronous, no waiting, unbounded staleness (the model of Hogwild!-
style and DistBelief's Downpour SGD; the A-BSP paper's ASP baseline).

Workers run `paramserver.gradient_worker`. The server applies each pushed gradient at once, as
one optimizer step with g / n (so that n pushes move the parameters as far as one BSP step of
the mean: `lr` means the same for every strategy), and replies with its current parameters.
Staleness of a gradient: updates applied between the version it was computed on and its own.
Each worker stops on its own (its epochs done, the time budget spent, or the target reached);
a worker that dies is dropped and the others carry on.
"""

from __future__ import annotations

from ako.strategies.ops import PeerLost, Recv
from ako.strategies.paramserver import PUSH, Shard, unpack


def server(sctx):
    """ASP server program."""
    shard = Shard(sctx)
    n = len(sctx.workers)
    running = set(sctx.workers)
    while running:
        try:
            m = yield Recv(PUSH)
        except PeerLost as lost:  # a dead worker: carry on without it
            running.discard(lost.rank)
            continue
        vote, version = unpack(m.aux, 1, 40)
        shard.seen(shard.version - version)
        shard.apply(m.tensor.div_(n))
        if vote:
            running.discard(m.src)
        yield from shard.reply(m.src, bool(vote))
    return shard.facts()
