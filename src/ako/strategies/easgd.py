"""Asynchronous EASGD: elastic averaging SGD with a centre variable on the servers (Zhang,
Choromanska and LeCun, "Deep learning with elastic averaging SGD", NIPS 2015, Algorithm 1).

Each worker runs local SGD with its own optimizer and the full `lr`. Every `tau` steps it sends
its parameters w to the servers; a server computes d = alpha * (w - x) for its shard of the
centre x, moves x += d at once (one atomic elastic update per exchange) and returns d; the
worker moves w -= d. alpha = beta / n (the paper's choice beta = n * alpha, default beta 0.9).
The optimizer state lives on the workers; the servers keep only x. The reported model is the
centre: when every worker has finished, the servers send x to rank 0, which evaluates it.
A worker that dies is dropped and the others carry on.
"""

from __future__ import annotations

import torch

from ako.strategies.ops import Compute, PeerLost, Recv, Send
from ako.strategies.paramserver import PULL, PUSH, Shard, pack, pull, push, unpack

CENTRE = 13


def worker(ctx):
    """EASGD worker program; rank 0 returns the final centre variable as `centre` (numel,)."""
    tau, replica = ctx.config.tau, ctx.replica
    delta = torch.empty_like(replica.params)
    t = 0
    while True:
        g = yield Compute()
        replica.step(g.grad)
        t += 1
        vote = ctx.stopping
        if vote or t % tau == 0:
            yield from push(ctx, replica.params, step=t, aux=pack((int(vote), 1)))
            yield from pull(ctx, delta)
            replica.params.sub_(delta)
        if vote:
            break
    facts = {"steps": t}
    if ctx.rank == 0:
        facts["centre"] = yield from _centre(ctx)
    return facts


def _centre(ctx):
    centre = torch.empty_like(ctx.replica.params)
    lo = 0
    for server in ctx.servers:
        part = (yield Recv(CENTRE, server)).tensor
        centre[lo : lo + len(part)].copy_(part)
        lo += len(part)
    return centre


def server(sctx):
    """EASGD server program: elastic updates of its shard of the centre variable."""
    shard = Shard(sctx)
    alpha = sctx.config.beta / len(sctx.workers)
    running = set(sctx.workers)
    while running:
        try:
            m = yield Recv(PUSH)
        except PeerLost as lost:  # a dead worker: carry on without it
            running.discard(lost.rank)
            continue
        (vote,) = unpack(m.aux, 1)
        d = m.tensor.sub_(shard.params).mul_(alpha)
        shard.params.add_(d)
        shard.updated()
        yield Send(d, m.src, PULL, shard.version, vote)
        if vote:
            running.discard(m.src)
    yield Send(shard.params.clone(), sctx.workers[0], CENTRE)
    return shard.facts()
