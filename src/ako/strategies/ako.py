"""Ako: decentralised partial gradient exchange (Watcharapichat et al., SoCC 2016).

Worker i keeps an accumulator A of all gradient it has not sent yet. Each step t it computes g,
adds g to A, sends the partition (t mod p) of A to every peer and zeroes that slice, and
applies to its replica its own g plus every partial gradient that peers have sent. Every
coordinate of every gradient thus reaches every replica within p steps plus network delay; at
the end each worker sends what is left of A (the flush), so no gradient is ever lost.

Learning-rate scaling: every gradient, own or received, is scaled by 1/n, so `lr` means what it
means for all-reduce (the rate of the averaged gradient). With p = 1 and staleness 0 a step
applies exactly sum_j g_j / n on every replica: all-reduce SGD.

Staleness bound s: after sending step t a worker waits until every peer has sent step t - s,
and it applies partial gradients from peers' steps <= t + s (later ones wait in its inbox), so
s = 0 is lock-step. With no bound it applies whatever has arrived.

A worker that dies is dropped: the others stop waiting for it, keep what it sent before, and
carry on (Ako has no single point of failure; what it had not sent yet is lost with it).
"""

from __future__ import annotations

import math

import torch

from ako.config import ConfigError
from ako.strategies.ops import AllReduce, Compute, MeasureBandwidth, MeasureStep, Message, PeerLost, Poll, Recv, Send
from ako.strategies.partition import auto_partitions, partition_bounds

TAG = 0  # partial gradients and the final flush
FLUSH = -1  # `aux` of the flush message, which carries the whole accumulator


def worker(ctx):
    """Worker program; returns the partitions used and why, for the run summary."""
    n, replica, s = ctx.world_size, ctx.replica, ctx.config.staleness
    p, reason = yield from choose_partitions(ctx)
    parts = partition_bounds(replica.numel, p, replica.boundaries)
    acc = torch.zeros_like(replica.params)
    update = torch.empty_like(replica.params)
    inbox = Inbox(ctx.peers, parts)
    t = 0
    while True:
        g = yield Compute()
        acc.add_(g.grad)
        lo, hi = parts[t % p]
        yield from send_to_peers(ctx, acc[lo:hi].clone(), step=t, aux=t % p)
        acc[lo:hi].zero_()
        if s is not None:
            while inbox.slowest() < t - s:
                yield from receive(inbox)
        for message in (yield Poll(TAG)):
            inbox.add(message)
        update.copy_(g.grad)
        inbox.apply(update, up_to=None if s is None else t + s)
        replica.step(update.div_(n))
        t += 1
        if ctx.stopping:
            break
    yield from send_to_peers(ctx, acc, step=t, aux=FLUSH)
    while not inbox.all_flushed():
        yield from receive(inbox)
    update.zero_()
    inbox.apply(update, up_to=None)
    if update.any():  # nothing left (p = 1, lock-step) means no extra optimizer step
        replica.step(update.div_(n))
    return {"steps": t, "partitions": p, "partitions_reason": reason}


def receive(inbox):
    """Wait for one partial gradient and file it; a peer found dead is dropped instead."""
    try:
        inbox.add((yield Recv(TAG)))
    except PeerLost as lost:
        inbox.drop(lost.rank)


def check(config, numel: int) -> None:
    """Raise ConfigError when --partitions exceeds the model's parameter count."""
    if config.partitions != "auto" and config.partitions > numel:
        raise ConfigError(f"partitions {config.partitions}: must be at most the model's parameter count {numel}")


def send_to_peers(ctx, tensor: torch.Tensor, step: int, aux: int):
    """Yield one `Send` of `tensor` (shared, not modified afterwards) to every peer."""
    for peer in ctx.peers:
        yield Send(tensor, peer, TAG, step, aux)


def choose_partitions(ctx):
    """p from --partitions, or Ako's auto rule with the most constrained worker's step time and
    link budget (both agreed by one all-reduce). Returns (p, a one-line reason)."""
    n, numel, grad_bytes = ctx.world_size, ctx.replica.numel, ctx.replica.grad_bytes
    if ctx.config.partitions != "auto":
        return ctx.config.partitions, "set by --partitions"
    if n == 1:
        return 1, "a single worker has no peers"
    given = ctx.config.bandwidth_bytes
    step_time = yield MeasureStep()
    bandwidth = given if given is not None else (yield MeasureBandwidth())
    worst = torch.tensor([-step_time, -bandwidth], dtype=torch.float64)
    yield AllReduce(worst, "max")
    step_time, bandwidth = -worst[0].item(), -worst[1].item()
    p = auto_partitions(n, grad_bytes, bandwidth, step_time, numel)
    source = "given" if given is not None else "measured"
    need = (n - 1) * grad_bytes
    reason = (
        f"auto: (n-1) x gradient = {need / 1e6:.2f} MB per step must fit B x T_step = "
        f"{bandwidth / 1e6:.1f} MB/s ({source}) x {step_time * 1e3:.1f} ms (measured) = "
        f"{bandwidth * step_time / 1e6:.2f} MB, so p = ceil({need / (bandwidth * step_time):.2f}) = {p}"
    )
    return p, reason


class Inbox:
    """Partial gradients received and not yet applied, and what each peer has sent so far."""

    def __init__(self, peers: list[int], parts: list[tuple[int, int]]):
        self.parts = parts
        self.pending: list[Message] = []
        self.last_step = {peer: -1 for peer in peers}
        self.flushed: set[int] = set()

    def add(self, message: Message) -> None:
        """File a received message and note how far its sender has got."""
        self.pending.append(message)
        if message.aux == FLUSH:
            self.flushed.add(message.src)
        elif message.src in self.last_step:  # not from a peer dropped since it was sent
            self.last_step[message.src] = max(self.last_step[message.src], message.step)

    def drop(self, peer: int) -> None:
        """`peer` died: wait for nothing more from it (what it sent stays to be applied)."""
        self.last_step.pop(peer, None)
        self.flushed.discard(peer)

    def slowest(self) -> float:
        """The lowest step heard from any peer still training (-1 before any, inf when none)."""
        steps = [s for peer, s in self.last_step.items() if peer not in self.flushed]
        return min(steps, default=math.inf)

    def all_flushed(self) -> bool:
        """Whether every peer has sent its final flush."""
        return self.flushed >= self.last_step.keys()

    def apply(self, update: torch.Tensor, up_to: int | None) -> None:
        """Add into `update` every pending message from steps <= up_to (all when None)."""
        keep = []
        for m in self.pending:
            if up_to is not None and m.aux != FLUSH and m.step > up_to:
                keep.append(m)
            elif m.aux == FLUSH:
                update.add_(m.tensor)
            else:
                lo, hi = self.parts[m.aux]
                update[lo:hi].add_(m.tensor)
        self.pending = keep
