"""Asynchronous EASGD: elastic averaging SGD with a centre variable on the servers (Zhang,
Choromanska and LeCun, "Deep learning with elastic averaging SGD", NIPS 2015, Algorithm 1).

Each worker runs local SGD with its own optimizer (momentum, Nesterov: the paper's EAMSGD) and the
full `lr` (with an adaptive optimizer, sqrt(n) x lr under `--lr-scaling auto`, `ako.optim.lr_factor`:
the centre averages the workers' own normalised steps). Every `tau` steps it sends its parameters w to the servers; a server computes d = alpha * (w - x) for its shard of the
centre x, moves x += d at once (one atomic elastic update per exchange) and returns d; the
worker moves w -= d. alpha = beta / n (the paper's choice beta = n * alpha, default beta 0.9).
The optimizer state lives on the workers; the servers keep only x. The reported model is the
centre: when every worker has finished, the servers send x to rank 0, which evaluates it.
A worker that dies is dropped and the others carry on.

tau = auto (the default): the largest traffic a server can take. A round of every worker's
exchange brings n x G / S bytes (G the model's bytes, S servers) into each server; spread over
tau steps of T_step seconds it must fit the server's link B: tau = ceil(n G / (S B T_step)),
with T_step measured and B given by `--bandwidth` or measured (a ring probe of every rank).
With tau = 1 at ako's defaults one server is the bottleneck from 8 workers on (docs/results.md).
"""

from __future__ import annotations

import math

import torch

from ako.checks import Integer, Number
from ako.strategies.base import Option, Strategy
from ako.strategies.ops import Compute, MeasureBandwidth, MeasureStep, PeerLost, Recv, Send
from ako.strategies.ps.shard import SERVERS, Shard, check, pack, pull_shards, push_shards, staleness_summary, unpack
from ako.strategies.tags import EASGD_CENTRE, PS_REPLY, PS_PUSH

TAU_MAX = 1_000_000  # as --tau allows


def worker(ctx):
    """EASGD worker program; rank 0 returns the final centre variable as `centre` (numel,)."""
    replica = ctx.replica
    tau, reason = yield from choose_tau(ctx)
    delta = torch.empty_like(replica.params)
    t = 0
    while True:
        g = yield Compute()
        replica.step(g.grad)
        t += 1
        vote = ctx.stopping
        if vote or t % tau == 0:
            yield from push_shards(ctx, replica.params, step=t, aux=pack((int(vote), 1)))
            yield from pull_shards(ctx, delta)
            replica.params.sub_(delta)
        if vote:
            break
    facts = {"steps": t, "tau": tau, "tau_reason": reason}
    if ctx.rank == 0:
        facts["centre"] = yield from _centre(ctx)
    return facts


def choose_tau(ctx):
    """tau from --tau, or auto (module docstring). Returns (tau, a one-line reason)."""
    c = ctx.config
    if c.tau != "auto":
        return c.tau, "set by --tau"
    step_time = yield MeasureStep()
    bandwidth = c.bandwidth_bytes if c.bandwidth is not None else (yield MeasureBandwidth(ctx.replica.grad_bytes))
    servers = len(ctx.servers)
    need = ctx.world_size * ctx.replica.grad_bytes / servers
    ratio = need / (bandwidth * step_time) if bandwidth * step_time > 0 else math.inf
    tau = max(1, math.ceil(min(ratio, TAU_MAX)))
    source = "given" if c.bandwidth is not None else "measured"
    if math.isinf(bandwidth):
        return 1, "auto: the link is free (a simulated link without --bandwidth), so tau = 1"
    return tau, (
        f"auto: n x model / servers = {need / 1e6:.2f} MB per round must fit B x T_step = {bandwidth / 1e6:.4g} MB/s "
        f"({source}) x {step_time * 1e3:.3g} ms (a step's compute) = {bandwidth * step_time / 1e6:.3g} MB a step, "
        f"so tau = ceil({ratio:.2f}) = {tau}" + (f" (at most {TAU_MAX})" if tau == TAU_MAX else "")
    )


def _centre(ctx):
    centre = torch.empty_like(ctx.replica.params)
    lo = 0
    for server in ctx.servers:
        part = (yield Recv(EASGD_CENTRE, server)).tensor
        centre[lo : lo + len(part)].copy_(part)
        lo += len(part)
    return centre


def server(sctx):
    """EASGD server program: elastic updates of its shard of the centre variable."""
    if sctx.config.tau == "auto" and sctx.config.bandwidth is None:
        yield MeasureBandwidth(sctx.replica.grad_bytes)  # every rank takes part in the workers' probe
    shard = Shard(sctx)
    alpha = sctx.config.beta / len(sctx.workers)
    running = set(sctx.workers)
    while running:
        try:
            m = yield Recv(PS_PUSH, awaiting=frozenset(running))
        except PeerLost as lost:  # a dead worker: carry on without it
            running.discard(lost.rank)
            continue
        (vote,) = unpack(m.aux, 1)
        d = m.tensor.sub_(shard.params).mul_(alpha)
        shard.params.add_(d)
        shard.updated()
        yield Send(d, m.src, PS_REPLY, shard.version, vote)
        if vote:
            running.discard(m.src)
    yield Send(shard.params.clone(), sctx.workers[0], EASGD_CENTRE)
    return shard.facts()


STRATEGY = Strategy(
    name="easgd",
    worker=worker,
    server=server,
    replicas_differ=True,
    survives_loss=True,
    averages_own_steps=True,
    options=(
        SERVERS,
        Option(name="tau", help="steps between elastic averaging rounds, or auto (its servers' links allow; the default)",
               default="auto", check=Integer("tau", 1, TAU_MAX, auto=True)),
        Option(name="beta", help="moving rate beta; elastic alpha = beta / workers", check=Number("beta", 0.0, 1.0)),
        Option(name="bandwidth", help="link budget of tau = auto, e.g. 1Gbit or 100MB (default: measured)"),
    ),
    check=check,
    summarise=staleness_summary,
    paper="Zhang, Choromanska and LeCun, NIPS 2015 (asynchronous EAMSGD)",
)  # fmt: skip
