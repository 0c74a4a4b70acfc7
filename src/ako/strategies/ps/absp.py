"""A-BSP: BSP whose iteration ends when the first worker finishes (Wang et al., "Aggressive
synchronization with partial processing for iterative ML jobs on clusters", Middleware 2018).

Each iteration every worker works through its assignment in micro-batches (`ComputePartial`).
When a server receives the first push of a whole assignment, it tells every worker that has
not pushed yet to stop after its current micro-batch; each pushes the SUM of the gradients of
the samples it processed and their count. When every worker has pushed, the server applies
sum / count over all of them (the mean gradient of every sample processed) as one optimizer
step and releases the next iteration. A worker's unprocessed samples go first in its next
assignment, so no sample starves. A stop cuts an assignment only while more than LATE_SHARE of
it is left: a worker less than about a quarter of a step behind the first hands in the whole
of it. So when every worker keeps within that of the fastest, every assignment is whole and
A-BSP is BSP (the summary's `handed_in` is then 100%).
"""

from __future__ import annotations

import torch

from ako.strategies.base import Option, Strategy
from ako.strategies.micro_batch import check_micro_batch, default_micro_batch
from ako.strategies.ops import ComputePartial, Poll, Recv, Send
from ako.strategies.ps.shard import SERVERS, Shard, check, pack, pull_shards, push_shards, staleness_summary, unpack
from ako.strategies.tags import ABSP_STOP, PS_PUSH

# A worker is cut short only while more than this share of its assignment is left when the
# first whole one comes, i.e. when it is more than about a quarter of a step's compute behind:
# with no straggler, ordinary timing noise on a loaded machine cut 1-5% of assignments in their
# last micro-batch, and absp then differed from bsp from run to run.
LATE_SHARE = 0.25


def worker(ctx):
    """A-BSP worker program; its facts: the mean fraction of its assignment it handed in per
    iteration, and the greatest age (iterations) a waiting sample reached. Iterations are
    numbered as the server's versions, from the step a resumed run starts at."""
    handed_in, oldest, t = 0.0, 0, ctx.resumed_step
    while True:
        part = yield ComputePartial(ctx.config.micro_batch, ABSP_STOP, t, LATE_SHARE)
        yield Poll(ABSP_STOP)  # drop this iteration's stop, if it came: ComputePartial leaves it in the inbox
        whole = part.samples == part.assigned
        vote = int(ctx.stopping)
        yield from push_shards(ctx, part.grad_sum, step=t, aux=pack((vote, 1), (int(whole), 1), (part.samples, 32)))
        _, finish = yield from pull_shards(ctx, ctx.replica.params)
        handed_in += part.samples / part.assigned
        oldest = max(oldest, part.oldest)
        t += 1
        if finish:
            return {"steps": t, "handed_in": round(handed_in / (t - ctx.resumed_step), 4), "oldest_waiting": oldest}


def server(sctx):
    """A-BSP server program."""
    shard = Shard(sctx)
    empty = torch.empty(0)
    while True:
        total, count, finish, told, pushed = torch.zeros_like(shard.params), 0, False, False, set()
        while len(pushed) < len(sctx.workers):
            m = yield Recv(PS_PUSH, awaiting=frozenset(sctx.workers) - pushed)
            vote, whole, samples = unpack(m.aux, 1, 1, 32)
            total.add_(m.tensor)
            count += samples
            finish |= bool(vote)
            pushed.add(m.src)
            shard.seen(shard.version)
            if whole and not told:  # the first whole assignment ends the iteration
                told = True
                for w in sctx.workers:
                    if w not in pushed:
                        yield Send(empty, w, ABSP_STOP, shard.version)
        shard.apply(total.div_(count))
        for w in sctx.workers:
            yield from shard.reply(w, finish)
        if finish:
            return shard.facts()


def summarise(reports: list[dict]) -> dict:
    """Staleness, and over the workers: the mean fraction handed in, the oldest waiting sample."""
    workers = [r for r in reports if r["role"] == "worker"]
    return {
        **staleness_summary(reports),
        "handed_in": round(sum(r["handed_in"] for r in workers) / len(workers), 4),
        "oldest_waiting": max(r["oldest_waiting"] for r in workers),
    }


STRATEGY = Strategy(
    name="absp",
    optimizer_on="servers",
    lockstep=True,
    worker=worker,
    server=server,
    options=(SERVERS, Option(name="micro_batch", help="samples per interruptible micro-batch (default batch-size / 4)",
                             default=default_micro_batch, check=check_micro_batch)),
    check=check,
    summarise=summarise,
    paper="Wang et al., Middleware 2018",
)  # fmt: skip
