"""SSP and ASP parameter servers: Stale Synchronous Parallel (Ho et al., "More effective
distributed ML via a stale synchronous parallel parameter server", NIPS 2013), and its unbounded
case, Asynchronous Parallel (as in DistBelief's Downpour SGD).

Workers run `workers.update_worker`: compute a gradient, take their own optimizer step on it
(momentum, Nesterov and weight decay live on the worker, as in BytePS's asynchronous mode), push
the parameter delta, pull. The server adds each pushed delta at once, scaled by 1/n (so that n
pushes move the parameters as far as one BSP step of the mean: `lr` means the same for every
strategy) and by `staleness_scale` (1 unless the push is more than n - 1 updates stale), so a
pull returns every update that has arrived. Each worker has a clock (its pushes
so far); a worker that has pushed clock c may start c + 1 only once the slowest running worker
has pushed clock c - s, so it has seen every update of clocks <= c - s - 1, Ho et al.'s
guarantee. `asp` has no bound: the reply is at once. Both start in lock-step: for the first
WARMUP_CLOCKS clocks the bound is 0, so the workers' momentum buffers fill from fresh gradients
before asynchrony begins (measured in docs/results.md, experiment 3: without it 2 of 60 cells,
ssp with s = 1 and asp at a 2x straggler, diverged in their first epoch; a warm-up in the
spirit of Goyal et al.'s and DGC's). With s = 0 every push of clock c was
computed on the same parameters, and the mean of the n workers' momentum steps is BSP's momentum
step (a momentum buffer is linear in the gradients): SSP equals BSP with momentum, Nesterov and
weight decay.

Each worker finishes on its own vote (its epochs done, the time budget spent, the target
reached) and stops counting towards the bound; it gets its final parameters when every worker
has finished, so all end with the same model, every update in. A worker that dies is dropped (the run goes on
only for `asp`: the launcher ends an `ssp` run at once). Staleness of a gradient: updates
applied between the version it was computed on and its own.
"""

from __future__ import annotations

from ako.checks import Integer
from ako.strategies.base import Option, Strategy
from ako.strategies.ops import PeerLost, Recv
from ako.strategies.ps.shard import SERVERS, Shard, check, staleness_summary, unpack
from ako.strategies.ps.workers import update_worker
from ako.strategies.tags import PS_PUSH

WARMUP_CLOCKS = 12  # the first clocks run in lock-step (s = 0), while the momentum buffers fill
DEFAULT_STALENESS = 2  # ssp\'s bound when none is given


def ssp_server(sctx):
    """SSP server program, with the bound `--staleness`."""
    return (yield from server(sctx, sctx.config.staleness))


def asp_server(sctx):
    """ASP server program: SSP with no bound."""
    return (yield from server(sctx, None))


def staleness_scale(workers: int, staleness: int) -> float:
    """The weight of a push that is `staleness` server updates old: min(1, n / (staleness + 1)),
    a staleness-aware learning rate (Zhang et al., IJCAI 2016, lr / staleness) that leaves alone
    the staleness every push has when n workers take turns (up to n - 1) and damps only a
    straggler's older ones. Measured in docs/results.md (experiment 3): without it `asp` with a
    4x straggler missed 80% in one seed of three."""
    return min(1.0, workers / (staleness + 1))


def server(sctx, bound: int | None):
    """The server program for staleness bound `bound` (None: none)."""
    n = len(sctx.workers)
    shard = Shard(sctx)
    clock = {w: 0 for w in sctx.workers}  # clocks pushed by the running workers
    held: dict[int, tuple[int, bool]] = {}  # worker -> (clock it pushed, finishing) awaiting a reply
    while clock or held:
        try:
            m = yield Recv(PS_PUSH, awaiting=frozenset(clock) - held.keys())  # the held ones wait on us
        except PeerLost as lost:  # a dead worker: carry on without it
            clock.pop(lost.rank, None)
            held.pop(lost.rank, None)
        else:
            vote, version = unpack(m.aux, 1, 40)
            shard.add(m.tensor, staleness_scale(n, shard.seen(version)) / n)
            clock[m.src] = m.step + 1
            if vote:
                del clock[m.src]
            held[m.src] = (m.step, bool(vote))
        slowest = min(clock.values(), default=None)
        s = 0 if slowest is not None and slowest < WARMUP_CLOCKS else bound
        for worker, (c, finish) in list(held.items()):
            if slowest is None or (not finish and (s is None or slowest >= c + 1 - s)):
                del held[worker]
                yield from shard.reply(worker, finish)
    return shard.facts()


SSP = Strategy(
    name="ssp",
    worker=update_worker,
    averages_own_steps=True,
    stale_steps=True,
    server=ssp_server,
    options=(SERVERS, Option(name="staleness", help="staleness bound s (default 2)", default=DEFAULT_STALENESS,
                             check=Integer("staleness", 0, 1000))),
    check=check,
    summarise=staleness_summary,
    paper="Ho et al., NIPS 2013",
)  # fmt: skip
ASP = Strategy(
    name="asp", worker=update_worker, server=asp_server, survives_loss=True, averages_own_steps=True, stale_steps=True,
    options=(SERVERS,), check=check,
    summarise=staleness_summary, paper="asynchronous parameter servers (Dean et al. 2012, Downpour SGD)",
)
