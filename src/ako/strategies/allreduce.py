"""All-reduce SGD: the synchronous data-parallel baseline (what DDP does).

Each step every worker computes the gradient g_i of its own mini-batch, bucketed all-reduces
that overlap backward sum the flat gradients (`ops.ComputeAllReduce`, as DDP's reducer), and
every replica applies w <- w - lr * mean_i(g_i) with the same optimizer. With equal per-worker
batches this is single-process SGD on the union of the n mini-batches.
"""

from __future__ import annotations


from ako.strategies.base import Strategy
from ako.strategies.ops import ComputeAllReduce


def worker(ctx):
    """Worker program. The stop vote rides in the gradient's first bucket
    (`ReducedGradient.stopping`), so the workers agree on the last step at no cost."""
    n = ctx.world_size
    steps = 0
    while True:
        g = yield ComputeAllReduce()
        ctx.replica.step(g.grad.div_(n))
        steps += 1
        if g.stopping:
            return {"steps": steps}


STRATEGY = Strategy(name="allreduce", worker=worker, lockstep=True, paper="synchronous SGD, as DistributedDataParallel does")
