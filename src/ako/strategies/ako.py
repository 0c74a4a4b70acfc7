"""Ako: decentralised partial gradient exchange (Watcharapichat et al., SoCC 2016), in the
delay-tolerant form of delayed gradient averaging (DGA; Zhu et al., NeurIPS 2021).

Every worker i takes its own optimizer step (momentum, Nesterov, weight decay) on its own
gradient at once, at full weight, as a local SGD step does: that fresh step stands in for the
mean of all workers' steps. It adds its parameter delta to an accumulator A and, each step t,
sends the partition k = t mod p of A (the window of the last p steps' deltas of that slice) to
its peers and zeroes it, keeping the window it sent in a ledger under step t. When peer j's
window of step t arrives (and the worker has itself done step t), the worker adds
(window_j - own window of step t) / n to that partition: it swaps 1/n of its own stand-in for
1/n of the peer's. Every own delta thus ends up at weight 1/n and every peer's at 1/n, so the
replicas' average moves by the mean of all workers' updates each step, and after the final
flush (each worker sends what is left of A) every replica is identical:
w_end = w_0 + (1/n) x the sum of every worker's deltas. With p = 1 and staleness 0 a step is
exactly all-reduce SGD with the same optimizer, because a worker's momentum buffer is linear in
its gradients (the mean of the n buffers is all-reduce's buffer).

Why this form and not the paper's literal one (apply own g/n at once, add the peers' partial
gradients as they come, one momentum on the receiver): that puts a delay of 1 to p steps inside
a loop whose effective step is lr / (1 - momentum) = 1.0, which diverges even at p = 1 (for a
quadratic, heavy-ball with its update delayed one step is stable only for lr x curvature <
1 - momentum). Here the delay only corrects the difference between the own step and the mean.

With an adaptive optimizer (AdamW) the mean of the workers' own steps is short (normalised steps
on independent noise). So by default (`default_form`) each step's mean window m of deltas goes
through an outer optimizer, SGD with Nesterov momentum as in DiLoCo (Douillard et al., arXiv
2311.08105): b <- mu b + m, and the partition moves by lr (m + mu b) in place of the own window
(`--outer-lr` 0.7, `--outer-momentum` 0.9: DiLoCo's; 0.8 and 0.6 below 8 workers). That is
Streaming DiLoCo (arXiv 2501.18512) with H = p fragments of one step each and tau = s,
keeping the steps taken while a window travels; at p = 1, s = 0 it is DiLoCo with H = 1. Like DiLoCo's H, p then needs to span several steps
(p = auto takes 8 to 100, fewer for small steps: `p_outer`). It needs a step's whole mean at once: the ring. On
all-to-all, adaptive optimizers get DGA's windows of gradients (GradientSteps).

Two exchanges of the windows (`--exchange`):
- `all-to-all` (the paper's): each window goes to all n - 1 peers, (n-1) x G / p bytes per
  worker per step for a gradient of G bytes. A worker that dies is dropped: its ledger entries
  are settled as if it had sent nothing more, and nothing waits for it.
- `ring`: the n windows of step t are summed by one all-reduce (a ring: 2 (n-1)/n x G / p
  bytes per worker per step, whatever n), started at once and applied s steps later, so it
  overlaps the next steps' computation. A collective needs every worker: a lost worker ends
  the run. `auto` picks all-to-all below RING_FROM workers where it fits the link with
  p <= p_max, and the ring otherwise (`choose_plan`).

p and the staleness bound s: see `choose_plan` (p = auto is capped at `p_max`),
DEFAULT_STALENESS and `choose_staleness` (s = auto on the ring with an outer step). A worker
waits, after sending step t, until every peer has sent step t - s, so the ledger holds at most
s + 1 windows and the link's backlog stays bounded: when the link cannot carry the traffic,
the steps wait for it (backpressure).

Partial steps behind a straggler (A-BSP's partial processing, Wang et al., Middleware 2018,
applied to Ako's steps; s >= 1): the bound would make every worker wait for the slowest. A
worker is the last at step t when a peer has already reached step t + s - 1 as it begins (that
peer then waits for this worker's step t - 1). Some worker is the last of every step; one that
is the last STRAGGLER_STEPS steps in a row is a straggler, and it stays one while its steps are
cut short. A straggler computes its mini-batch in micro-batches and stops after the current one
once a peer reaches step t + s - 1 (its window of that step comes; on the ring, the next rank's
progress message), or after one micro-batch when one had already: that peer is one step from
waiting for it, which leaves a step's time for the rest of the micro-batch and the window's
way. The step uses the gradient sum over the samples done divided by the mini-batch size, a
step smaller in proportion, so that every sample of every worker weighs the same in the
replicas' average, as in an all-reduce over the samples processed. The samples not done go
first next step, so none is skipped. The fast workers hardly wait, and the straggler keeps
their pace in steps of fewer samples. (With s = 0 every step waits for the slowest, as
all-reduce does.)
"""

from __future__ import annotations

import math
from collections import deque
from itertools import islice
from dataclasses import dataclass, field, replace

import torch

from ako.checks import ConfigError, Integer, Number
from ako.strategies.base import Option, Strategy
from ako.strategies.compress import CODECS, COMPRESSIONS, Codec
from ako.strategies.mean import Mean
from ako.strategies.micro_batch import check_micro_batch, default_micro_batch
from ako.strategies.nesterov import Nesterov
from ako.strategies.ops import (AllReduce, Compute, ComputePartial, MeasureAllReduce, MeasureBandwidth, MeasureStep, Message,
                               PeerLost, Poll, Recv, Send)  # fmt: skip
from ako.strategies.partition import auto_partitions, partition_bounds
from ako.strategies.tags import AKO_LOSS, AKO_PROGRESS, AKO_REPLICA, AKO_WINDOW

_EMPTY = torch.empty(0)  # the ring's progress messages carry nothing but their step
FLUSH = -1  # `aux` of the flush message, which carries the whole accumulator; its `step` is the sender's step count
_FLUSH_STEP = 1 << 62  # the ledger's key for the own flush, after every step
P_MAX = 8  # the most partitions p = auto chooses (measured: docs/results.md, experiment 1) ...
P_MAX_SMALL_BATCH = 4  # ... but at fewer than SMALL_BATCH samples a step, where p = 8 diverged
SMALL_BATCH = 16
DEFAULT_STALENESS = 1  # steps a worker may run ahead of the slowest peer it has heard from ...
S_AUTO_MAX = 4  # ... on the ring with an outer step, as many as cover a window's all-reduce, at most this many
S_SLACK = 0.1  # (`choose_staleness`) a wait under a tenth of a step, or a measurement's noise, is not worth a step more of staleness
RING_FROM = 8  # `--exchange auto`: the ring from this many workers on
EXCHANGES = ("auto", "all-to-all", "ring")  # --exchange
UPDATES = ("auto", "deltas", "gradients")  # --update
PLAIN_SWAP = (1.0, 0.0)  # (outer lr, outer momentum) of Ako's own swap: no outer step
OUTER_STEP = (0.7, 0.9)  # ... and of its outer step, the default for optimizers other than sgd: DiLoCo's, ...
OUTER_STEP_FEW = (0.8, 0.6)  # ... but below RING_FROM workers, whose mean step is longer (`default_form`)
P_OUTER = (8, 100)  # p = auto with an outer step: at least 8 (shorter windows lost), at most DiLoCo's H = 100 ...
OUTER_CAP_PER_SAMPLE = 4  # ... and at most 4 x a step's samples (`p_outer`)
AUTO_CODE = "int8"  # --compress auto: the windows' code where float32 would be link-bound (`code_for`)


def worker(ctx):
    """Worker program; returns the exchange, partitions and why, for the run summary, and on
    rank 0 its replica before the flush (`unflushed`, (numel,)), so the run can hand back the
    better of the two models."""
    exchange, p, reason, budget, codec = yield from choose_plan(ctx)
    s, why = yield from choose_staleness(ctx, exchange, p, budget, codec)
    reason += why
    parts = partition_bounds(ctx.replica.numel, p, ctx.replica.boundaries)
    run = _ring if exchange == "ring" else _all_to_all
    steps, unflushed = yield from run(ctx, parts, s, codec)
    update, (lr, momentum) = form(ctx.config)
    windows = update if (lr, momentum) == PLAIN_SWAP else f"{update} with an outer step (lr {lr:g}, momentum {momentum:g})"
    windows += f", sent as {codec.name}" if codec.lossy else ""
    facts = {"steps": steps, "exchange": exchange, "partitions": p, "partitions_reason": reason, "staleness_bound": s,
             "windows": windows, "compress": codec.name}
    if ctx.rank == 0:
        facts["unflushed"] = unflushed
    return facts


class LocalSteps:
    """Windows of deltas (`--update deltas`): the own optimizer steps and the accumulator A of
    their deltas not yet sent (numel,). The peers' corrections go into the replica itself
    (`target`), at once."""

    def __init__(self, replica):
        self.replica = replica
        self.acc = torch.zeros_like(replica.params)
        self.before = torch.empty_like(replica.params)
        self.target = replica.params

    def step(self, grad: torch.Tensor) -> None:
        """One optimizer step with `grad` on the replica; its delta goes into A."""
        self.before.copy_(self.replica.params)
        self.replica.step(grad)
        self.acc.sub_(self.before.sub_(self.replica.params))  # acc += after - before, without rounding acc into params

    def finish(self) -> None:
        """The step is done already (`step`)."""

    def end(self, ctx):
        """Nothing after the flush: it has made the replicas equal."""
        return
        yield

    def take(self, lo: int, hi: int) -> torch.Tensor:
        """A[lo:hi] (a copy), zeroed in A: the window of those coordinates to send."""
        window = self.acc[lo:hi].clone()
        self.acc[lo:hi].zero_()
        return window

    def take_coded(self, lo: int, hi: int, codec: Codec) -> tuple[torch.Tensor, torch.Tensor]:
        """The window A[lo:hi] as `codec`'s payload, and what that decodes to; what the code
        left out stays in A (error feedback in Ako's own accumulator: it goes with the next
        window of those coordinates, or the flush)."""
        window = self.take(lo, hi)
        if not codec.lossy:
            return window, window
        payload = codec.encode(window)
        sent = codec.decode(payload, hi - lo)
        self.acc[lo:hi].add_(window.sub_(sent))
        return payload, sent


class GradientSteps(LocalSteps):
    """Windows of gradients (`--update gradients`, DGA's own form): A accumulates the raw
    gradients, and the peers' corrections (peer's window - own window) / n go into a buffer
    (`target`) that joins the next optimizer step's gradient: step t's optimizer step is taken,
    after the exchange, on g_t + the corrections settled by then (`finish`). With p = 1, s = 0
    that is the mean gradient, so Ako is all-reduce for any optimizer (AdamW's step is not
    linear in the gradient: the mean of the workers' AdamW deltas is not AdamW's step on the
    mean gradient)."""

    def __init__(self, replica):
        super().__init__(replica)
        self.target = torch.zeros_like(replica.params)
        self.grad = torch.zeros_like(replica.params)

    def step(self, grad: torch.Tensor) -> None:
        """Note step t's gradient (numel,) and add it to A; the optimizer steps in `finish`."""
        self.grad.copy_(grad)
        self.acc.add_(grad)

    def finish(self) -> None:
        """The optimizer step on the gradient plus the corrections settled since the last one."""
        self.replica.step(self.grad.add_(self.target))
        self.target.zero_()

    def end(self, ctx):
        """After the flush the replicas differ (each went through its own optimizer state), so
        they are made one: their mean."""
        yield from average_replicas(ctx, set(), always=True)


def takes_partial_steps(ctx, s: int) -> bool:
    """Whether a straggler takes partial steps: s >= 1 (with s = 0 every step waits for the
    slowest anyway), peers, and `micro_batch` below a step's samples."""
    return s >= 1 and ctx.world_size > 1 and ctx.config.micro_batch < ctx.config.step_samples


STRAGGLER_STEPS = 3  # steps in a row a worker is the last before it counts as a straggler


class Pace:
    """A worker's steps, whole or partial (see the module docstring). `last` counts the steps
    in a row that began with a peer already at step t + s - 1 (that peer waited for this
    worker's step t - 1: it was the last); `share` is the share of its samples the last step
    took. (The run's summary counts the steps cut short from the data cursor, which a
    checkpoint keeps.)"""

    def __init__(self, ctx, s: int):
        self.ctx, self.s = ctx, s
        self.on = takes_partial_steps(ctx, s)
        self.last, self.share = 0, 1.0

    def gradient(self, t: int, heard: float, signal: int):
        """Step t's gradient (numel,), given the highest step `heard` from a peer: the whole
        mini-batch's mean; or, for a straggler (the last at STRAGGLER_STEPS steps in a row, or
        cut short at its last step), the sum over the micro-batches done, over the step's
        samples. A partial step stops once a message `signal` (a peer's progress) of step
        t + s - 1 comes, or after one micro-batch when one had come already."""
        behind = heard >= t + self.s - 1
        self.last = self.last + 1 if behind else 0
        if not (self.on and (self.last >= STRAGGLER_STEPS or self.share < 1)):
            self.share = 1.0
            return (yield Compute()).grad
        config = self.ctx.config
        part = yield ComputePartial(config.micro_batch, signal, None if behind else t + self.s - 1)
        self.share = part.samples / part.assigned
        return part.grad_sum.div_(config.step_samples)


def _all_to_all(ctx, parts, s, codec: Codec):
    n, replica = ctx.world_size, ctx.replica
    own = own_steps(ctx)
    ledger = Ledger(ctx.peers, n, own.target, parts, codec)
    pace = Pace(ctx, s)
    t = 0
    while True:
        own.step((yield from pace.gradient(t, ledger.fastest(), AKO_WINDOW)))
        lo, hi = parts[t % len(parts)]
        payload, window = own.take_coded(lo, hi, codec)
        ledger.sent(t, lo, hi, window)
        yield from send_to_peers(ctx, payload, step=t, aux=t % len(parts))
        while ledger.slowest() < t - s:
            yield from receive(ledger, ledger.laggard())
        for message in (yield Poll(AKO_WINDOW)):
            ledger.add(message)
        ledger.settle(up_to=t)
        own.finish()
        t += 1
        if ctx.stopping:
            break
    unflushed = replica.params.clone() if ctx.rank == 0 else None
    window = own.take(0, replica.numel)
    ledger.sent(_FLUSH_STEP, 0, replica.numel, window)
    yield from send_to_peers(ctx, window, step=t, aux=FLUSH)
    ledger.settle(up_to=_FLUSH_STEP)
    while not ledger.all_flushed():
        yield from receive(ledger, ledger.laggard())
        ledger.settle(up_to=_FLUSH_STEP)
    assert not ledger.own and not ledger.pending, "Ako's ledger must be settled after the flush"
    yield from average_replicas(ctx, ledger.dead)
    yield from own.end(ctx)
    return t, unflushed


def own_steps(ctx) -> LocalSteps:
    """The own steps of the run's form (`form`): windows of deltas (`LocalSteps`), or of
    gradients (`GradientSteps`)."""
    return GradientSteps(ctx.replica) if form(ctx.config)[0] == "gradients" else LocalSteps(ctx.replica)


def form(config) -> tuple[str, tuple[float, float]]:
    """What a window carries and the outer step on each mean window: (deltas or gradients,
    (outer lr, outer momentum)); `default_form`'s for the run's optimizer, exchange and workers,
    with `--update`, `--outer-lr` and `--outer-momentum` where given."""
    adaptive = not (config.optimizer == "sgd" and config.optimizer_fn is None)
    return default_form(adaptive, config.exchange, config.workers, config.update, config.outer_lr, config.outer_momentum)


def default_form(adaptive: bool, exchange: str, workers: int, update: str = "auto", outer_lr: float | None = None,
                 outer_momentum: float | None = None) -> tuple[str, tuple[float, float]]:  # fmt: skip
    """`form` for an optimizer `adaptive` or not (sgd). sgd: windows of deltas, the plain swap (at
    p = 1, s = 0 that is all-reduce, sgd's step being linear in its gradients). Any other
    (AdamW): windows of deltas with the outer step OUTER_STEP on the ring (OUTER_STEP_FEW below
    RING_FROM workers); but windows of
    gradients (DGA's form) where `exchange` is all-to-all, which never holds a step's whole mean,
    and no outer step for a single worker, which has nothing to average. Measured
    (docs/results.md): with AdamW the outer step at p >= 8 beat windows of gradients on the
    small and the default gpt, 4 to 64 workers. The outer values (with beta1 0.5): DiLoCo's from
    RING_FROM workers on (simulated, small gpt, 8 to 64 workers: as good or better than 0.8 and
    0.6, and the only ones of the two to reach the target at 64), 0.8 and 0.6 below (4 workers
    on the default gpt, loopback and netcluster: with DiLoCo's Ako ended 0.07 nats higher). The
    mean of n workers' normalised steps is shorter the more workers there are, and the outer
    momentum lengthens it."""
    outer_fits = adaptive and exchange != "all-to-all" and workers > 1
    if update == "auto":
        update = "gradients" if adaptive and not outer_fits else "deltas"
    outer = OUTER_STEP if workers >= RING_FROM else OUTER_STEP_FEW
    lr, momentum = outer if outer_fits and update == "deltas" else PLAIN_SWAP
    return update, (lr if outer_lr is None else outer_lr, momentum if outer_momentum is None else outer_momentum)


def stale_steps(config) -> bool:
    """Whether the workers' own optimizer steps are taken on stale parameters: always, but in
    lock-step (p = 1, s = 0, which is all-reduce). A worker steps on its replica while its
    peers' windows of the last p + s steps are still to come, so Adam's beta1 is lowered there
    (`ako.optim.stale_betas`; measured on the gpt, docs/results.md: with beta1 0.9 Ako ended
    0.15 nats above allreduce on loopback, with 0.5 below it)."""
    staleness = given_staleness(config)
    return config.workers > 1 and (config.partitions, DEFAULT_STALENESS if staleness is None else staleness) != (1, 0)


def given_staleness(config) -> int | None:
    """`--staleness` as a number, or None where it is auto (unset or "auto": `choose_staleness`)."""
    return None if config.staleness in (None, "auto") else config.staleness


def survives_loss(config) -> bool:
    """Whether the run goes on without a lost worker: on all-to-all, not on the ring, which
    `choose_plan` takes for sure with `--exchange ring`, an outer step, or from RING_FROM workers
    on. (Where it takes the ring only because all-to-all would not fit the link, this says True
    and the loss still ends the run.)"""
    if config.exchange != "auto":
        return config.exchange == "all-to-all"
    return form(config)[1] == PLAIN_SWAP and config.workers < RING_FROM


def average_replicas(ctx, dead: set[int], always: bool = False):
    """Make the surviving replicas the same after a loss. Without one the flush has made them
    equal (to float rounding); after one, a lost worker's last windows may have reached some
    survivors and not others (in flight when it died), and the replicas differ by those
    windows / n. Each worker tells every peer not known `dead` whether it lost a peer before
    that peer's flush came (one byte; a peer in no one's `dead` had its flush, which follows
    all its windows, reach every survivor). When any did, each sends its replica to the peers
    whose answer came and takes the mean of those that come, summed in rank order: every
    survivor computes the same bits, settling the lost worker's windows the same way on each.
    A peer lost meanwhile is left out. `always`: average whether or not a worker was lost
    (windows of gradients leave the replicas apart after the flush)."""
    flag = torch.tensor([int(bool(dead) or always)], dtype=torch.uint8)
    flags = yield from _exchange(ctx, [peer for peer in ctx.peers if peer not in dead], flag, AKO_LOSS)
    if not (dead or always or any(f.item() for f in flags.values())):
        return
    mine = ctx.replica.params.detach().to("cpu", copy=True)
    replicas = {ctx.rank: mine, **(yield from _exchange(ctx, sorted(flags), mine, AKO_REPLICA))}
    total = torch.zeros_like(mine)
    for rank in sorted(replicas):
        total.add_(replicas[rank])
    ctx.replica.params.copy_(total.div_(len(replicas)))


def _exchange(ctx, peers: list[int], tensor: torch.Tensor, tag: int):
    """Send `tensor` to each of `peers` and receive theirs (tag `tag`): {rank: tensor} of
    those that came (a peer lost meanwhile is left out)."""
    for peer in peers:
        yield Send(tensor, peer, tag)
    got = {}
    for peer in peers:
        while peer not in got:
            try:
                got[peer] = (yield Recv(tag, peer)).tensor
            except PeerLost as lost:
                if lost.rank == peer:
                    break  # lost meanwhile (another peer's loss, reported here, changes nothing)
    return got


def receive(ledger: Ledger, peer: int):
    """Wait for `peer`'s next window and file it; a peer found dead (or silent for the
    timeout) is dropped instead."""
    try:
        ledger.add((yield Recv(AKO_WINDOW, peer)))
    except PeerLost as lost:
        ledger.drop(lost.rank)


def send_to_peers(ctx, tensor: torch.Tensor, step: int, aux: int):
    """Yield one `Send` of `tensor` (shared, not modified afterwards) to every peer."""
    for peer in ctx.peers:
        yield Send(tensor, peer, AKO_WINDOW, step, aux)


@dataclass
class _Entry:
    """An own window sent at one step: coordinates [lo, hi), the window, and the peers whose
    window of that step is still to come (each takes 1/n of the window back when it does)."""

    lo: int
    hi: int
    window: torch.Tensor
    owing: set[int] = field(default_factory=set)


class Ledger:
    """The own windows sent and the peers' windows received, paired as DGA pairs them.

    Invariant: each own window is taken back, window / n, exactly once per peer: when that
    peer's window of the same step is applied, or at once for a peer that is dead or finished
    before that step (as if it had sent zeros). Each peer's window is added, window / n,
    exactly once. A peer's window of step t waits until this worker has done step t itself
    (`settle(up_to)`); a flush is applied as soon as it arrives. `params` (numel,) is the
    replica these corrections go into; `parts` the [lo, hi) of each partition.
    """

    def __init__(self, peers: list[int], n: int, params: torch.Tensor, parts: list[tuple[int, int]], codec: Codec = CODECS["none"]):
        self.n, self.params, self.parts, self.codec = n, params, parts, codec
        self.own: dict[int, _Entry] = {}  # step -> own window, until every peer has settled it
        self.pending: list[Message] = []
        self.last_step = {peer: -1 for peer in peers}  # the latest step heard from each live peer
        self.dead: set[int] = set()

    def sent(self, step: int, lo: int, hi: int, window: torch.Tensor) -> None:
        """Record the own window of `step` (coordinates [lo, hi)); settle it at once for the
        peers that are dead or finished (their windows of this step, if any, are added alone)."""
        entry = _Entry(lo, hi, window, set(self.last_step))
        gone = self.n - 1 - len(entry.owing)
        if gone:
            self.params[lo:hi].sub_(window, alpha=gone / self.n)
        if entry.owing:
            self.own[step] = entry

    def add(self, message: Message) -> None:
        """File a received window and note how far its sender has got (a flush: it is done,
        and nothing waits for it any more). A window's payload is decoded (`codec`); the flush
        travels in float32."""
        if self.codec.lossy and message.aux != FLUSH:
            lo, hi = self.parts[message.aux]
            message = replace(message, tensor=self.codec.decode(message.tensor, hi - lo))
        self.pending.append(message)
        if message.aux == FLUSH:
            self.last_step.pop(message.src, None)
        elif message.src in self.last_step:
            self.last_step[message.src] = max(self.last_step[message.src], message.step)

    def settle(self, up_to: int) -> None:
        """Apply, in arrival order, every pending window of a step <= `up_to` and every flush."""
        keep = []
        for m in self.pending:
            if m.aux == FLUSH:
                self._apply_flush(m)
            elif m.src in self.dead or m.step <= up_to:
                self._apply(m)
            else:
                keep.append(m)
        self.pending = keep

    def _apply(self, m: Message) -> None:
        lo, hi = self.parts[m.aux]
        self.params[lo:hi].add_(m.tensor, alpha=1 / self.n)
        if m.src not in self.dead:
            self._take_back(m.step, m.src)

    def _apply_flush(self, m: Message) -> None:
        self.params.add_(m.tensor, alpha=1 / self.n)
        for step in [step for step in self.own if step >= m.step]:  # windows it will never send
            self._take_back(step, m.src)

    def _take_back(self, step: int, peer: int) -> None:
        entry = self.own.get(step)
        if entry is None or peer not in entry.owing:
            return
        self.params[entry.lo : entry.hi].sub_(entry.window, alpha=1 / self.n)
        entry.owing.discard(peer)
        if not entry.owing:
            del self.own[step]

    def drop(self, peer: int) -> None:
        """`peer` died: apply what it sent, settle every own window it still owed as if it had
        sent zeros, and wait for nothing more from it."""
        for m in [m for m in self.pending if m.src == peer]:
            self.pending.remove(m)
            (self._apply_flush if m.aux == FLUSH else self._apply)(m)
        for step in list(self.own):
            self._take_back(step, peer)
        self.dead.add(peer)
        self.last_step.pop(peer, None)

    def slowest(self) -> float:
        """The lowest step heard from any peer still training (-1 before any, inf when none)."""
        return min(self.last_step.values(), default=math.inf)

    def fastest(self) -> float:
        """The highest step heard from any peer still training (-1 before any or when none)."""
        return max(self.last_step.values(), default=-1)

    def laggard(self) -> int:
        """The live peer still training that is furthest behind (the one to wait for)."""
        return min(self.last_step, key=self.last_step.get)

    def all_flushed(self) -> bool:
        """Whether every live peer's flush has arrived (`settle` applies them)."""
        return not self.last_step


def _ring(ctx, parts, s, codec: Codec):
    """The ring exchange: step t's windows summed by an all-reduce started at once and applied
    s steps later. The stop vote rides in the window's last element, so every worker sees
    the same votes at the same step and all stop together, s steps after the first vote (at
    the planned last step itself when the run goes to its end).
    With partial steps, each worker tells the previous rank (an empty message) when it has
    started a step's all-reduce: a collective does not say who the others wait for, and one
    neighbour ahead is enough for a straggler to know it is behind."""
    n, replica = ctx.world_size, ctx.replica
    own = own_steps(ctx)
    mean = Mean(ctx.rank, n, codec, replica.numel, replica.params.device)
    inflight: deque = deque()  # (lo, hi, own window, the mean under way), oldest first
    outer = outer_step(ctx.config, replica)
    t, stop, heard = 0, False, -1
    pace = Pace(ctx, s)
    while not (stop or ctx.plan_done()):  # a vote to stop early lands s steps later; the plan's end is known to all
        if pace.on:
            heard = max([heard] + [m.step for m in (yield Poll(AKO_PROGRESS))])
        own.step((yield from pace.gradient(t, heard, AKO_PROGRESS)))
        lo, hi = parts[t % len(parts)]
        window = own.take(lo, hi)
        inflight.append((lo, hi, window, (yield from mean.start(window, lo, ctx.stopping))))
        if pace.on:
            yield Send(_EMPTY, (ctx.rank - 1) % n, AKO_PROGRESS, step=t)
        for *_, older in islice(inflight, len(inflight) - 1):  # a compressed mean's second half goes out a step after its first
            yield from mean.reduce(older)
        t += 1
        while len(inflight) > s:
            stop |= yield from _settle_ring(own.target, mean, outer, *inflight.popleft())
        own.finish()
    while inflight:
        yield from _settle_ring(own.target, mean, outer, *inflight.popleft())
    unflushed = replica.params.clone() if ctx.rank == 0 else None
    if isinstance(own, GradientSteps):  # the replicas went through their own optimizer states: one mean
        total = yield AllReduce(replica.params.clone(), "sum")
        replica.params.copy_(total.div_(n))
        return t, unflushed
    window = own.take(0, replica.numel)
    owed = window.clone() if mean.residual is None else window + mean.residual.error  # what the codes left out goes too
    total = yield AllReduce(owed, "sum")
    replica.params.add_(total.div_(n).sub_(window))
    if outer is not None:  # equal to float rounding, each replica through its own adds: one mean makes them one
        total = yield AllReduce(replica.params.clone(), "sum")
        replica.params.copy_(total.div_(n))
    return t, unflushed


def _settle_ring(target: torch.Tensor, mean: Mean, outer: Nesterov | None, lo: int, hi: int, mine: torch.Tensor, pending):
    """Wait for one step's mean and swap the own window for it, or for the outer optimizer's
    step on it, in `target` (the replica, or the gradient's corrections); returns the vote."""
    m, votes = yield from mean.finish(pending)
    if outer is not None:
        m = outer.direction([(lo, hi)], m)
    target[lo:hi].add_(m.sub_(mine))
    return votes > 0


def outer_step(config, replica) -> Nesterov | None:
    """The outer optimizer on the mean windows of deltas (`form`), or None for Ako's plain swap
    (lr 1, momentum 0)."""
    lr, momentum = form(config)[1]
    return None if (lr, momentum) == PLAIN_SWAP else Nesterov(replica.numel, lr, momentum, replica.params.device)


def check(config, replica) -> None:
    """Raise ConfigError when --partitions exceeds the model's parameter count, or an outer
    optimizer is asked for where there is no mean window of deltas to step on (windows of
    gradients, or the all-to-all exchange, which never holds a step's mean at once)."""
    if config.partitions != "auto" and config.partitions > replica.numel:
        raise ConfigError(f"partitions {config.partitions}: must be at most the model's parameter count {replica.numel}")
    update, outer = form(config)
    if outer == PLAIN_SWAP:
        return
    if config.exchange == "all-to-all":
        raise ConfigError(f"outer lr {outer[0]:g} and momentum {outer[1]:g}: an outer step needs --exchange ring or auto "
                          "(all-to-all applies each peer's window as it comes, never a step's whole mean)")  # fmt: skip
    if update != "deltas":
        given = "auto, which is gradients for one worker" if config.update == "auto" else repr(config.update)
        raise ConfigError(f"outer lr {outer[0]:g} and momentum {outer[1]:g}: an outer step needs windows of deltas (--update deltas; "
                          f"here update is {given})")  # fmt: skip


def choose_plan(ctx):
    """The exchange, p and the windows' code, and why: (exchange, p, a one-line reason, the
    `Budget` measured or None where p needed none, the `Codec`).

    `--exchange auto` takes all-to-all, which survives a lost worker, where it fits the link
    with p <= p_max, and the ring (fewer bytes whatever n) from RING_FROM workers on or where
    all-to-all would not fit. p from --partitions, or Ako's auto rule (Ako, sec. 3): the
    smallest p whose traffic fits the link budget B x T_step, with the most constrained
    worker's step time and link (agreed by one all-reduce), capped at `p_max`, or between the
    bounds `p_outer` with an outer step; the reason starts "link-bound: ..." when the cap binds,
    i.e. the steps will wait for the link. The code: `--compress`, where auto is float32, but
    with an outer step AUTO_CODE where the link binds at float32 (`code_for`; the plain swap's
    auto is float32: measured only with the outer step)."""
    n, c = ctx.world_size, ctx.config
    ring_only = form(c)[1] != PLAIN_SWAP  # an outer step needs each step's whole mean
    compress = c.compress if ring_only or c.compress != "auto" else "none"
    given = CODECS["none" if compress == "auto" else compress]
    if n == 1:
        auto = "ring" if ring_only else "all-to-all"
        return (auto if c.exchange == "auto" else c.exchange), 1, "a single worker has no peers", None, given
    if c.partitions != "auto":
        exchange = c.exchange if c.exchange != "auto" else ("ring" if n >= RING_FROM or ring_only else "all-to-all")
        return exchange, c.partitions, "set by --partitions", None, given
    bounds = p_outer(c.step_samples) if ring_only else (1, p_max(c.step_samples))
    budget = yield from measure_budget(ctx, *bounds)
    if c.exchange != "auto":
        p, reason, codec = code_for(compress, budget, c.exchange, n, ctx.replica.numel)
        return c.exchange, p, reason, budget, codec
    p, reason, codec = code_for(compress, budget, "all-to-all", n, ctx.replica.numel)
    if n < RING_FROM and not reason.startswith("link-bound") and not ring_only:
        return "all-to-all", p, reason, budget, codec
    p, reason, codec = code_for(compress, budget, "ring", n, ctx.replica.numel)
    why = (f"there are {n} workers (the ring from {RING_FROM} on)" if n >= RING_FROM
           else "an outer step needs each step's whole mean" if ring_only
           else f"all-to-all would need more than p = {budget.cap}")  # fmt: skip
    return "ring", p, f"{reason}; the ring, as {why}", budget, codec


def code_for(compress: str, budget: "Budget", exchange: str, n: int, numel: int) -> tuple[int, str, Codec]:
    """p = auto, why, and the windows' code for `--compress` (p from the code's bytes: a window
    travels coded). `auto` is float32 where it fits the link within p's cap, else AUTO_CODE:
    a link-bound step waits for its window, and int8's 1.03 bytes a value (INTELLECT-1's code)
    cut that wait to about a quarter (simulated, the small gpt at 64 workers on 10 Mbit/s: 13.5 s
    to the target with s = 2 against 46.9 s at float32, and at s = 1 19.3 s against bf16's 36.2;
    docs/results.md, "Ako against DiLoCo")."""
    codec = CODECS["none" if compress == "auto" else compress]
    p, reason = budget.partitions(exchange, n, codec.nbytes(numel), numel)
    if compress != "auto" or not reason.startswith("link-bound"):
        return p, reason, codec
    float32 = budget.wanted(exchange, n, codec.nbytes(numel), numel)
    codec = CODECS[AUTO_CODE]
    p, reason = budget.partitions(exchange, n, codec.nbytes(numel), numel)
    return p, (f"{reason}; the bytes are {AUTO_CODE}'s: --compress auto takes {AUTO_CODE} windows, as float32 ones "
               f"would be link-bound (p = {float32} > {budget.cap})"), codec


def measure_budget(ctx, floor: int = 1, cap: int = P_MAX):
    """The link budget every worker agrees on: the slowest worker's step time (seconds) and
    link (bytes/s; `--bandwidth` where given), by one all-reduce."""
    given = ctx.config.bandwidth_bytes
    step_time = yield MeasureStep()
    bandwidth = given if given is not None else (yield MeasureBandwidth(ctx.replica.grad_bytes))
    worst = torch.tensor([-step_time, -bandwidth], dtype=torch.float64)
    yield AllReduce(worst, "max")
    return Budget(-worst[1].item(), -worst[0].item(), "given" if given is not None else "measured", floor, cap)


def choose_staleness(ctx, exchange: str, p: int, budget: "Budget | None", codec: Codec):
    """The staleness bound s and why (a clause for the summary, "" where there is nothing to
    say): `--staleness` where given, else DEFAULT_STALENESS; but on the ring with an outer step
    s = auto, Streaming DiLoCo's tau (arXiv 2501.18512: a fragment's all-reduce overlaps
    tau inner steps): the fewest steps with which no step waits for an all-reduce, at most
    S_AUTO_MAX. A worker settles step t's window when step t + s's compute ends, so where the
    all-reduce (T_allreduce, timed, latency included) binds, a step takes (T_allreduce +
    T_step) / (s + 1); it cannot take less than T, the longer of a step's compute T_step and
    the window's transfer (the link's pace). So s = ceil((T_allreduce + T_step) / T - 1 -
    S_SLACK). With s = 1 a worker waits each step for the rest of the all-reduce: at 64
    workers on 1 Gbit/s, the ring's 2 (n - 1) x 50 us of latency is 6.3 ms against a step's
    2.4 ms (docs/results.md, "Ako against DiLoCo and Streaming DiLoCo"). With a lossy code s is
    at least 2: a compressed mean's second half goes out a step after its first (`_ring`), so at
    s = 1 every step would wait for it (simulated, 16 workers on 10 Mbit/s, int8: s = 2 reached
    the target in 5.4 virtual s against 11.8 at float32)."""
    n, c = ctx.world_size, ctx.config
    if (given := given_staleness(c)) is not None:
        return given, ""
    if exchange != "ring" or n == 1 or form(c)[1] == PLAIN_SWAP:
        return DEFAULT_STALENESS, ""
    if budget is None:
        budget = yield from measure_budget(ctx)
    window = codec.nbytes(-(-ctx.replica.numel // p))
    seconds = yield MeasureAllReduce(window)
    transfer = 2 * (n - 1) / n * window / budget.bandwidth  # 0 on a free link
    period = max(budget.step_time, transfer)
    if period > 0:
        need = (seconds + budget.step_time) / period - 1 - S_SLACK
    else:  # steps that take no time (a simulation without compute or link): only the latency counts
        need = math.inf if seconds > 0 else 0.0
    lowest = 2 if codec.lossy else 1
    s = min(max(math.ceil(min(need, S_AUTO_MAX)), lowest), S_AUTO_MAX)
    rule = (f"s >= ({seconds * 1e3:.3g} + {budget.step_time * 1e3:.3g}) / {period * 1e3:.3g} ms - {1 + S_SLACK:g} = "
            f"{need:.2f}{', capped' if need > S_AUTO_MAX else ''}" if period > 0 else "the steps take no time")  # fmt: skip
    halves = f", and at least 2 for {codec.name} windows: a compressed mean's second half goes a step after its first" if lowest > 1 else ""
    return s, (f"; staleness s = {s} (auto: a window's all-reduce takes {seconds * 1e3:.3g} ms; the fewest s from 1 "
               f"to {S_AUTO_MAX} that hides it, {rule}{halves})")  # fmt: skip


def p_max(step_samples: int) -> int:
    """The most partitions p = auto takes for workers of `step_samples` samples a step.

    Each partition is refreshed every p steps, so a replica carries up to p of its own steps in
    place of its peers' mean; the noisier a step, the sooner that drifts. Measured in the
    simulator (docs/results.md, experiment 1, 100 Mbit/s, where the cap binds): p = 8 against
    p = 4 reached 80% in 0.5-0.9x the time at 8 to 32 workers of 64 to 16 samples, but at 64
    workers of 8 samples p = 8 diverged on one seed of two (p = 4 trained on all three)."""
    return P_MAX if step_samples >= SMALL_BATCH else P_MAX_SMALL_BATCH


def p_outer(step_samples: int) -> tuple[int, int]:
    """(floor, cap) of p = auto with an outer step, for workers of `step_samples` samples a
    step: at least 8, at most 100 (DiLoCo's H) and 4 x step_samples (the floor where that is
    less). A window sums p of a worker's own steps; AdamW's steps have about lr's size however
    noisy, so windows of many small steps drift. Measured in the simulator (docs/results.md,
    "Ako against DiLoCo", GPT, 10 Mbit/s, where the link asks for more): at 16 workers of 8
    sequences p = 73 never reached the target loss in 3 epochs, p = 32 did (in 0.35x Streaming
    DiLoCo's time), p = 16 later; at 8 workers of 16, p = 34 did; at 64 workers of 2, p = 31 ended
    higher than p = 4."""
    low, high = P_OUTER
    return low, max(low, min(high, OUTER_CAP_PER_SAMPLE * step_samples))


@dataclass(frozen=True)
class Budget:
    """A worker's link budget: `bandwidth` (bytes/s, `source` given or measured) times the
    measured seconds of a step, `step_time`; p is at least `floor` and at most `cap`."""

    bandwidth: float
    step_time: float
    source: str
    floor: int = 1
    cap: int = P_MAX

    def wanted(self, exchange: str, n: int, grad_bytes: int, numel: int) -> int:
        """The fewest partitions whose bytes a step fit B x T_step, uncapped (`partitions`)."""
        need = (n - 1) * grad_bytes if exchange == "all-to-all" else 2 * (n - 1) * grad_bytes / n
        return auto_partitions(need, self.bandwidth, self.step_time, numel)

    def partitions(self, exchange: str, n: int, grad_bytes: int, numel: int) -> tuple[int, str]:
        """p for `exchange`: (n-1) x G / p bytes a step all-to-all, 2 (n-1)/n x G / p on the
        ring must fit B x T_step; at least `floor`, at most `cap`. Returns (p, why)."""
        need = (n - 1) * grad_bytes if exchange == "all-to-all" else 2 * (n - 1) * grad_bytes / n
        floor = min(self.floor, numel)
        if math.isinf(self.bandwidth):
            return floor, f"auto: the link is free (a simulated link without --bandwidth), so p = 1{raised(floor)}"
        wanted = self.wanted(exchange, n, grad_bytes, numel)
        p = min(max(wanted, floor), self.cap)
        what = "(n-1) x gradient" if exchange == "all-to-all" else "2 (n-1)/n x gradient (ring)"
        b, t = self.bandwidth, self.step_time
        if p >= wanted:
            return p, (
                f"auto: {what} = {need / 1e6:.2f} MB per step must fit B x T_step = {b / 1e6:.4g} MB/s "
                f"({self.source}) x {t * 1e3:.3g} ms (a step's compute) = {b * t / 1e6:.3g} MB, "
                f"so p = ceil({need / (b * t):.2f}) = {wanted}{raised(p) if p > wanted else ''}"
            )
        per_step = need / p
        return p, (
            f"link-bound: the link budget asks for p = {wanted}, capped at {self.cap} to keep the delay short; "
            f"{what} / {p} = {per_step / 1e6:.2f} MB per step takes {per_step / b * 1e3:.1f} ms at "
            f"{b / 1e6:.4g} MB/s ({self.source}), longer than the {t * 1e3:.3g} ms of a step's compute: on such a "
            "link the steps wait for it"
        )


def raised(p: int) -> str:
    """Why p = auto is above what the link needs: an outer step's floor (`p_outer`)."""
    return f", raised to {p}: an outer step needs windows of at least {p} steps (fewer trained worse)" if p > 1 else ""


def summarise(reports: list[dict]) -> dict:
    """Over all workers: the partial steps that left samples waiting (`partial_steps`) and the
    samples taken fewer than whole steps would have (`samples_short`)."""
    workers = [r for r in reports if r["role"] == "worker"]
    return {key: sum(r[key] for r in workers) for key in ("partial_steps", "samples_short")}


STRATEGY = Strategy(
    name="ako",
    worker=worker,
    replicas_differ=True,
    survives_loss=survives_loss,
    stale_steps=stale_steps,
    check=check,
    summarise=summarise,
    options=(
        Option(name="partitions", help="number of gradient partitions p, or auto (the link budget's, at most 8, 4 below 16 samples a step; with an outer step 8 to 100, at most 4 x a step's samples)",
               check=Integer("partitions", 1, auto=True)),
        Option(name="exchange", help="all-to-all (every peer gets each window), ring (an all-reduce of each window), "
               "or auto (ring from 8 workers on, with an outer step, or where all-to-all would not fit the link)",
               choices=EXCHANGES),
        # no default here (None is DEFAULT_STALENESS): config.toml would record it, and ssp would take it from there
        Option(name="staleness", help="staleness bound s (0 = lock-step), or auto (the default): 1, but on the "
               "ring with an outer step the fewest steps that hide a window's all-reduce, 1 to 4)", check=Integer("staleness", 0, 1000, auto=True)),
        Option(name="micro_batch", help="samples per micro-batch of a straggler's partial steps "
               "(default batch-size / 4; a step's samples, batch-size x accumulate, turn them off)",
               default=default_micro_batch, check=check_micro_batch),
        Option(name="bandwidth", help="link budget of p = auto, e.g. 1Gbit or 100MB (default: measured)"),
        Option(name="compress", help="how a window travels: none (float32), bf16, int8 (a scale per 128 values) or "
               "fp4 (E3M0, a scale per 128 values); what a lossy code leaves out stays in the accumulator (all-to-all) or "
               "a residual (ring) and goes later (error feedback); the final flush goes in float32; or auto (the default): "
               f"float32, but with an outer step {AUTO_CODE} where float32 windows would be link-bound (p = auto at its cap)",
               default="auto", choices=("auto", *COMPRESSIONS)),
        # no defaults here (None is default_form's): config.toml would record them, and diloco would take them from there
        Option(name="outer_lr", help="the outer optimizer's lr on each mean window of deltas, on the ring "
               "(Streaming DiLoCo's outer step with H = p; on the ring, so a lost worker ends the run; default 0.7 for "
               "optimizers other than sgd (0.8 below 8 workers), 1 for sgd: the plain swap, no outer step)", check=Number("outer_lr", 1e-6, 100.0)),
        Option(name="outer_momentum", help="the outer optimizer's Nesterov momentum (default 0.9 for optimizers other than sgd, 0.6 below 8 workers, "
               "0 for sgd)",
               check=Number("outer_momentum", 0.0, 0.999)),
        Option(name="update", help="what a window carries: deltas (each worker's own optimizer steps), gradients "
               "(the optimizer steps on the gradient plus the peers' corrections: all-reduce at p = 1, s = 0 for any "
               "optimizer), or auto (deltas; for optimizers other than sgd gradients where --exchange is all-to-all)", choices=UPDATES),
    ),
    paper="Watcharapichat et al., SoCC 2016; the update as delayed gradient averaging (Zhu et al., NeurIPS 2021)",
)  # fmt: skip
