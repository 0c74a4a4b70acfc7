"""The workers' programs of the parameter-server strategies: compute a gradient, push it (or the
worker's own update) to the servers, pull the parameters back (`shard.push_shards`,
`shard.pull_shards`)."""

from __future__ import annotations

import torch

from ako.strategies.ops import Compute
from ako.strategies.ps.shard import pack, pull_shards, push_shards


def gradient_worker(ctx):
    """The worker of bsp: compute a gradient with the parameters last pulled, push it (with the
    worker's clock, the version it was computed on and its stop vote), pull the parameters the
    server releases, until a server says finish."""
    return (yield from _worker(ctx, lambda g: g.grad))


def update_worker(ctx):
    """The worker of ssp and asp: as `gradient_worker`, but it takes its own optimizer step on
    the gradient (the replica's, with the worker's momentum buffer) and pushes the resulting
    parameter delta, -lr x (the momentum step), which the servers add, scaled by 1/n."""
    return (yield from _worker(ctx, OwnStep(ctx.replica)))


class OwnStep:
    """The worker's own optimizer step on a gradient, returning the parameter delta it made,
    after - before (numel; a buffer reused every step)."""

    def __init__(self, replica):
        self.replica, self.delta = replica, torch.empty_like(replica.params)

    def __call__(self, g) -> torch.Tensor:
        self.delta.copy_(self.replica.params)
        self.replica.step(g.grad)
        return self.delta.sub_(self.replica.params).neg_()


def _worker(ctx, update):
    """Compute, push `update(gradient)`, pull, until a server's reply says finish. The worker
    only votes to stop (`ctx.stopping` in the push's aux): the servers decide the last step."""
    version, clock = 0, 0
    while True:
        g = yield Compute()
        vote = int(ctx.stopping)
        yield from push_shards(ctx, update(g), step=clock, aux=pack((vote, 1), (version, 40)))
        version, finish = yield from pull_shards(ctx, ctx.replica.params)
        clock += 1
        if finish:
            return {"steps": clock}
