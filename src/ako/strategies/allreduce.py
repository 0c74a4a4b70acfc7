"""All-reduce SGD: the synchronous data-parallel baseline (what DDP does).

Each step every worker computes the gradient g_i of its own mini-batch, one all-reduce sums
the flat gradients, and every replica applies w <- w - lr * mean_i(g_i) with the same optimizer.
With equal per-worker batches this is single-process SGD on the union of the n mini-batches.
"""

from __future__ import annotations


from ako.strategies.base import Strategy
from ako.strategies.ops import AllReduce, Compute


def worker(ctx):
    """Worker program. The stop vote rides in one extra element of the all-reduce buffer, so the
    workers agree on the last step without a second collective."""
    n = ctx.world_size
    buf = ctx.replica.params.new_empty(ctx.replica.numel + 1)
    grad, vote = buf[:-1], buf[-1:]
    steps = 0
    while True:
        g = yield Compute()
        grad.copy_(g.grad)
        vote.fill_(float(ctx.stopping))
        yield AllReduce(buf, "sum")
        ctx.replica.step(grad.div_(n))
        steps += 1
        if vote.item() > 0:
            return {"steps": steps}


STRATEGY = Strategy(name="allreduce", worker=worker, lockstep=True, paper="synchronous SGD, as DistributedDataParallel does")
