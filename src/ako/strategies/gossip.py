"""Gossiping SGD: decentralised averaging with one peer at a time, no server, no barrier.

Jin, Yuan, Iandola and Keutzer, "How to scale distributed deep learning?" (NIPS ML Systems
workshop 2016, arXiv:1611.04581): every worker runs SGD on its own replica, and every `tau`
steps it does one gossip round with one peer, in one of two ways (`--gossip`):

- pull: fetch the peer's latest parameter snapshot w_j and set w_i <- (w_i + w_j) / 2. Every
  worker publishes a snapshot of its parameters after each step (`Publish`); its runtime
  answers pulls in the background, so a worker being pulled from never stops training, and two
  workers that pull from each other at once (or many that pull from one) cannot deadlock.
- push-sum (Kempe, Dobra and Gehrke, FOCS 2003): each worker carries a weight a_i beside its
  parameters z_i. A round keeps half the weight and sends (z_i, a_i / 2) to the peer; a worker
  merges every state (z_k, a_k) it receives: z_i <- (a_i z_i + a_k z_k) / (a_i + a_k),
  a_i <- a_i + a_k. The weighted sum sum_i a_i z_i, messages in flight included, changes only
  by gradient steps, and the weights always sum to n: with learning rate 0 the weighted
  average of the replicas is preserved exactly once every message is delivered. Weights are
  integers in units of 2**-48 (they travel in the message header's `aux`), so their sum is
  conserved without rounding; the run's final average is weighted by them (`average_weight`).
  A worker pushes only to peers still training: one that has finished would keep all the
  weight sent to it, and the last steps of the workers still training would count for almost
  nothing.

Peers (`--peers`): `random` draws one live peer uniformly per round (seeded by the run seed
and the rank), as in Jin et al.; `rotating` follows `rotating_partner`, a hypercube schedule
that gives each worker at most one partner per round and spreads every replica's information
to all in log2(n) rounds (the fix of later work, e.g. GossipGraD, Daily et al. 2018, for
random gossip's uneven load and slow diffusion).

Learning rate: each replica applies its own gradient at `lr`, so the replicas' average moves
by lr * mean_i(g_i) per step, as under all-reduce (sgd). An adaptive optimizer's steps are
normalised on each worker's own noise, and their mean is up to sqrt(n) shorter: `--lr-scaling
auto` takes sqrt(n) x lr there (`ako.optim.lr_factor`).

End: a worker that stops training sends DONE to every live peer, and keeps merging pushes
(its runtime keeps answering pulls) until every live peer's DONE has arrived; so no push is
lost and no pull goes to a worker that has finished. A dead peer (the runtime survives
losses): it is dropped from peer selection (`Lost`); a pull from it raises PeerLost, which
ends that round only; what it held is gone with it.
"""

from __future__ import annotations

import math
import random

import torch

from ako.checks import Integer
from ako.strategies.base import Option, Strategy
from ako.strategies.ops import Compute, Lost, Message, PeerLost, Poll, Publish, Pull, Recv, Send
from ako.strategies.tags import GOSSIP_DONE, GOSSIP_PUSH

WEIGHT_UNIT = 2**48  # a worker's initial push-sum weight; n * 2**48 fits an int64 for n <= 4096
MODES = ("pull", "push-sum")  # --gossip
PEER_SELECTIONS = ("random", "rotating")  # --peers


def worker(ctx):
    """Worker program (pull or push-sum, as `ctx.config.gossip` says); returns its facts:
    steps, rounds (gossip rounds with a partner), failed rounds (peer died), and for push-sum
    its final weight `average_weight` (1.0 = its initial share)."""
    config = ctx.config
    select = PeerSelector(ctx.rank, ctx.world_size, config.peers, config.seed)
    if config.gossip == "push-sum":
        facts = yield from push_sum(ctx, select)
    else:
        facts = yield from pull(ctx, select)
    return {"gossip": config.gossip, "peers": config.peers, "tau": config.tau, **facts}


def pull(ctx, select: PeerSelector):
    """Pull gossip: local SGD; every tau steps w <- (w + w_peer) / 2 with the peer's snapshot."""
    replica, tau = ctx.replica, ctx.config.tau
    yield Publish(replica.params, 0)
    steps = rounds = failed = 0
    while True:
        g = yield Compute()
        replica.step(g.grad)
        steps += 1
        if steps % tau == 0:
            peer = select.next(rounds, (yield Lost()))
            if peer is not None:
                try:
                    snapshot = yield Pull(peer)
                    replica.params.lerp_(snapshot.tensor, 0.5)  # (w + w_peer) / 2 in one pass
                except PeerLost:
                    failed += 1
            rounds += 1
        yield Publish(replica.params, steps)
        if ctx.stopping:
            break
    yield from handshake(ctx)
    return {"steps": steps, "rounds": rounds, "failed_rounds": failed}


def push_sum(ctx, select: PeerSelector):
    """Push-sum gossip: local SGD; every tau steps send half the weight with the parameters to
    the peer; merge every state received."""
    replica, tau = ctx.replica, ctx.config.tau
    state = PushSumState(replica.params)
    finished: set[int] = set()  # peers whose DONE came: they merge pushes but no longer train
    steps = rounds = 0
    while True:
        g = yield Compute()
        replica.step(g.grad)
        steps += 1
        if steps % tau == 0:
            finished.update(m.src for m in (yield Poll(GOSSIP_DONE)))
            peer = select.next(rounds, (yield Lost()) | finished)
            half = state.weight // 2
            if peer is not None and half > 0:
                # a peer that dies takes the weight it holds (or is sent) with it: after a
                # loss the survivors' weights sum to less than n, and their average is theirs
                yield Send(replica.params.clone(), peer, GOSSIP_PUSH, steps, half)
                state.weight -= half
            rounds += 1
        state.merge_all((yield Poll(GOSSIP_PUSH)))
        if ctx.stopping:
            break
    yield from handshake(ctx, state, finished)
    state.merge_all((yield Poll(GOSSIP_PUSH)))  # every peer's DONE is in, so are all its pushes
    return {"steps": steps, "rounds": rounds, "average_weight": state.weight / WEIGHT_UNIT}


def handshake(ctx, state: PushSumState | None = None, done: set[int] = frozenset()):
    """End of training: send DONE to every live peer, then wait for the DONE of every live peer
    not in `done` (already received), each wait up to the run's timeout, merging the pushes that
    arrive meanwhile into `state` (push-sum). Messages from one peer arrive in order, so after
    its DONE nothing more comes from it."""
    lost = yield Lost()
    for peer in ctx.peers:
        if peer not in lost:
            yield Send(torch.empty(0), peer, GOSSIP_DONE)
    waiting = set(ctx.peers) - done
    while waiting:
        waiting -= yield Lost()
        if not waiting:
            break
        peer = min(waiting)
        try:
            yield Recv(GOSSIP_DONE, peer)
        except PeerLost:
            pass
        waiting.discard(peer)
        if state is not None:
            state.merge_all((yield Poll(GOSSIP_PUSH)))


class PushSumState:
    """Push-sum's weight (an int, in units of 2**-48) for the parameters `params` (numel,),
    which hold the de-biased estimate z = x / a (what the model computes with)."""

    def __init__(self, params: torch.Tensor):
        self.params = params
        self.weight = WEIGHT_UNIT

    def merge(self, message: Message) -> None:
        """z <- (a z + a_k z_k) / (a + a_k), a <- a + a_k for a received state (z_k, a_k)."""
        incoming = message.aux
        total = self.weight + incoming
        if incoming > 0:
            self.params.lerp_(message.tensor, incoming / total)
        self.weight = total

    def merge_all(self, messages: list[Message]) -> None:
        """Merge every message, oldest first."""
        for message in messages:
            self.merge(message)


class PeerSelector:
    """Whom a worker gossips with in round r: `random` (uniform over live peers, its own
    seeded generator) or `rotating` (`rotating_partner`; a round whose partner is dead or
    missing is sat out)."""

    def __init__(self, rank: int, world_size: int, how: str, seed: int):
        self.rank, self.world_size, self.how = rank, world_size, how
        self.rng = random.Random(f"ako-gossip/{seed}/{rank}")

    def next(self, round_: int, lost: frozenset[int]) -> int | None:
        """The partner for round `round_`, or None to sit the round out."""
        if self.how == "rotating":
            partner = rotating_partner(self.rank, round_, self.world_size)
            return None if partner is None or partner in lost else partner
        live = [r for r in range(self.world_size) if r != self.rank and r not in lost]
        return self.rng.choice(live) if live else None


def rotating_partner(rank: int, round_: int, n: int) -> int | None:
    """Hypercube (dimension-exchange) schedule: in round r, worker i's partner is
    i XOR 2^(r mod m), m = ceil(log2 n); None when that number is not a worker (>= n).

    Pairs are symmetric (j's partner is i), so every worker has at most one partner per round.
    For n a power of two every worker is paired exactly once per round, and after m
    consecutive rounds every worker's information has reached every other (with pairwise
    averaging done in lock-step, every replica would then equal the exact average). For other
    n the workers whose partner would be >= n sit the round out; information then reaches
    everyone within 2m - 1 rounds (checked for n <= 64 in the tests)."""
    if n < 2:
        return None
    m = math.ceil(math.log2(n))
    partner = rank ^ (1 << (round_ % m))
    return partner if partner < n else None


STRATEGY = Strategy(
    name="gossip",
    worker=worker,
    replicas_differ=True,
    survives_loss=True,
    averages_own_steps=True,
    options=(
        Option(name="tau", help="steps between gossip rounds (default 1)", default=1, check=Integer("tau", 1, 1_000_000)),
        Option(name="gossip", help="pull (average with a peer's snapshot) or push-sum", choices=MODES),
        Option(name="peers", help="random (uniform) or rotating (one partner per round, hypercube order)",
               choices=PEER_SELECTIONS),
    ),
    paper="Jin et al. 2016; push-sum: Kempe et al. 2003",
)  # fmt: skip
