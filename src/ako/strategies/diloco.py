"""DiLoCo (Douillard et al., arXiv 2311.08105) and Streaming DiLoCo (Douillard et al., arXiv
2501.18512): local training with an outer optimizer on the averaged pseudo-gradient.

DiLoCo: every worker takes H inner steps with the run's optimizer (AdamW in the papers) on its
own data; then the pseudo-gradient Delta_i = theta_global - theta_i (the replica at the last sync
minus now) is averaged over the n workers, and the outer optimizer, SGD with Nesterov momentum
(lr 0.7, momentum 0.9), steps theta_global with it:
    b <- mu b + mean_i Delta_i;  theta_global <- theta_global - lr_out (mean_i Delta_i + mu b)
after which every worker continues from theta_global. The inner optimizer's state is kept.

Streaming DiLoCo cuts the flat vector into P fragments (`fragments`) and syncs one of them every
H/P steps, so that each is synced once every H steps (fragment k at steps (k + 1) H/P + m H, as
torchft's `DiLoCo` orders them): its pseudo-gradient is taken tau steps before it is due, its
mean travels while the worker takes those tau steps, and on arrival the fragment becomes
    theta <- (1 - alpha) theta_global + alpha theta_local
(alpha = 0: the tau local steps on that fragment are dropped for the synced value). DiLoCo is
the case P = 1, tau = 0, alpha = 0, and is this same program.

The mean is a ring all-reduce, or compressed (`--compress`, with error feedback: `mean.py`).
The stop vote rides in every mean, so the workers stop together, after the sync where one
voted (or at the planned last step, which each knows); a sync under way then completes first.
A lost worker ends the run naming it, as under allreduce: a mean needs every worker (torchft
goes on with a smaller quorum; see docs/strategies.md). Not checkpointed: theta_global, the
outer momentum and the residuals; a resumed run starts the outer loop afresh from the mean of
the replicas.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ako.checks import ConfigError, Integer, Number
from ako.strategies.base import Option, Strategy
from ako.strategies.compress import CODECS, COMPRESSIONS
from ako.strategies.mean import Mean
from ako.strategies.nesterov import Nesterov, gather, scatter
from ako.strategies.ops import AllReduce, Compute

SYNC_EVERY = 100  # H: INTELLECT-1's (arXiv 2412.01152) and Streaming DiLoCo's; DiLoCo's own runs took 500
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # DiLoCo, sec. 3 (Nesterov)
FRAGMENTS, FRAGMENT_DELAY, FRAGMENT_ALPHA = 4, 1, 0.5  # Streaming DiLoCo's P, tau and alpha
CUTS = ("slices", "modules")  # --fragment-cut


@dataclass(frozen=True)
class Plan:
    """The outer loop's settings: H, the fragments (each a list of [lo, hi) ranges of the flat
    vector), tau, alpha, the outer optimizer's lr and momentum, and the code on the wire."""

    sync_every: int
    fragments: list[list[tuple[int, int]]]
    delay: int
    alpha: float
    lr: float
    momentum: float
    compress: str

    @property
    def every(self) -> int:
        """Steps between two fragments' syncs: H / P."""
        return self.sync_every // len(self.fragments)

    def due(self, t: int) -> int | None:
        """The fragment whose sync is due after step t (steps count from 1), or None."""
        return (t // self.every - 1) % len(self.fragments) if t % self.every == 0 else None


def plan(ctx, streaming: bool) -> Plan:
    """The run's `Plan`: the streaming options for streaming-diloco, P = 1, tau = 0, alpha = 0
    for diloco."""
    c, replica = ctx.config, ctx.replica
    if not streaming:
        fragments = [[(0, replica.numel)]]
        return Plan(c.sync_every, fragments, 0, 0.0, c.outer_lr, c.outer_momentum, c.compress)
    if c.fragment_cut == "modules":
        fragments = module_fragments(replica.model, c.fragments)
    else:
        fragments = [[part] for part in slices(replica.numel, c.fragments)]
    return Plan(c.sync_every, fragments, c.fragment_delay, c.fragment_alpha, c.outer_lr, c.outer_momentum, c.compress)


def slices(numel: int, p: int) -> list[tuple[int, int]]:
    """[lo, hi) of p equal slices of [0, numel) (sizes differ by at most one; a boundary may
    fall inside a tensor)."""
    return [(k * numel // p, (k + 1) * numel // p) for k in range(p)]


def module_units(model: torch.nn.Module) -> dict[str, list[tuple[int, int]]]:
    """The model's units in order, each with its [lo, hi) ranges of the flat vector: a
    parameter's unit is its name up to its first numbered part, such as `blocks.3`, else its
    first part, such as `tokens` (a module name: `model.get_submodule(unit)`)."""
    units: dict[str, list[tuple[int, int]]] = {}
    offset = 0
    for name, param in ((n, q) for n, q in model.named_parameters() if q.requires_grad):
        parts = name.split(".")
        numbered = next((i for i, part in enumerate(parts) if re.fullmatch(r"\d+", part)), None)
        unit = ".".join(parts[: numbered + 1]) if numbered is not None else parts[0]
        units.setdefault(unit, []).append((offset, offset + param.numel()))
        offset += param.numel()
    return units


def module_fragments(model: torch.nn.Module, p: int) -> list[list[tuple[int, int]]]:
    """p fragments of whole modules, strided as Streaming DiLoCo takes them (sec. 2.1): the
    model's units in order (`module_units`), unit u in fragment u mod p. Raises ValueError
    when the model has fewer than p units."""
    units = module_units(model)
    if len(units) < p:
        raise ValueError(f"fragments {p}: the model has only {len(units)} modules to cut ({', '.join(units)}); "
                         "take fewer fragments or --fragment-cut slices")  # fmt: skip
    fragments: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    for u, ranges in enumerate(units.values()):
        fragments[u % p].extend(ranges)
    return [_merged(f) for f in fragments]


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


class OuterSGD:
    """The outer optimizer: `Nesterov` on theta_global (numel,), stepped one fragment at a
    time."""

    def __init__(self, start: torch.Tensor, lr: float, momentum: float):
        self.params = start.detach().clone()
        self.nesterov = Nesterov(self.params.numel(), lr, momentum, self.params.device)

    def step(self, ranges: list[tuple[int, int]], grad: torch.Tensor) -> torch.Tensor:
        """One step of the fragment at `ranges` with `grad` (its size,); returns its new
        theta_global (its size,)."""
        new = gather(self.params, ranges).sub_(self.nesterov.direction(ranges, grad))
        scatter(self.params, ranges, new)
        return new


def _worker(ctx, streaming: bool):
    """Worker program (module docstring). Facts: steps, outer steps (syncs), H, P, and `sync_log`,
    int64 (syncs, 2): each sync's step and fragment."""
    p = plan(ctx, streaming)
    n, replica = ctx.world_size, ctx.replica
    if ctx.resumed_step:  # the replicas resumed apart (theta_global is not checkpointed): one mean
        total = yield AllReduce(replica.params.clone(), "sum")
        replica.params.copy_(total.div_(n))
    outer = OuterSGD(replica.params, p.lr, p.momentum)
    offsets = [0]
    for ranges in p.fragments:
        offsets.append(offsets[-1] + sum(hi - lo for lo, hi in ranges))
    mean = Mean(ctx.rank, n, CODECS[p.compress], replica.numel, replica.params.device)
    t, stop, log = ctx.resumed_step, False, []
    inflight = None  # (due step, fragment, Pending)
    while not (stop or ctx.plan_done()):
        g = yield Compute()
        replica.step(g.grad)
        t += 1
        k = p.due(t + p.delay)
        if k is not None:  # its pseudo-gradient now, its mean while the next tau steps run
            delta = gather(outer.params, p.fragments[k]).sub_(gather(replica.params, p.fragments[k]))
            inflight = (t + p.delay, k, (yield from mean.start(delta, offsets[k], ctx.stopping)))
        if inflight is not None and p.delay >= 2 and t == inflight[0] - p.delay // 2:
            yield from mean.reduce(inflight[2])  # halfway: the second half of a compressed mean goes out
        if inflight is not None and t == inflight[0]:
            stop = yield from _apply(p, outer, replica, mean, *inflight[1:])
            log.append((t, inflight[1]))
            inflight = None
    if inflight is not None:  # every worker ends with the same sync under way: complete it
        yield from _apply(p, outer, replica, mean, *inflight[1:])
        log.append((t, inflight[1]))
    return {"steps": t, "outer_steps": len(log), "sync_every": p.sync_every, "fragments": len(p.fragments),
            "sync_log": torch.tensor(log, dtype=torch.int64).view(-1, 2)}


def _apply(p: Plan, outer: OuterSGD, replica, mean: Mean, k: int, pending):
    """Wait for fragment k's mean pseudo-gradient, step theta_global with it, and set the
    fragment to (1 - alpha) theta_global + alpha theta_local. Returns whether a worker voted
    to stop."""
    delta, votes = yield from mean.finish(pending)
    synced = outer.step(p.fragments[k], delta)
    if p.alpha:
        synced = torch.lerp(synced, gather(replica.params, p.fragments[k]), p.alpha)
    scatter(replica.params, p.fragments[k], synced)
    return votes > 0


def diloco(ctx):
    """DiLoCo's worker program."""
    return (yield from _worker(ctx, streaming=False))


def streaming(ctx):
    """Streaming DiLoCo's worker program."""
    return (yield from _worker(ctx, streaming=True))


def check(config, replica) -> None:
    """torchft's constraints: P <= the parameter count (with --fragment-cut modules, the
    model's modules), H a multiple of P, tau < H / P. Raises ConfigError."""
    p = getattr(config, "fragments", None) or 1
    if p > replica.numel:
        raise ConfigError(f"fragments {p}: must be at most the model's parameter count {replica.numel}")
    if getattr(config, "fragment_cut", None) == "modules":
        try:
            module_fragments(replica.model, p)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if config.sync_every % p:
        raise ConfigError(f"sync_every {config.sync_every}: must be a multiple of fragments ({p}), "
                          "so that each fragment syncs once every sync_every steps")  # fmt: skip
    delay = config.fragment_delay or 0
    if delay >= config.sync_every // p:
        raise ConfigError(f"fragment_delay {delay}: must be below sync_every / fragments = {config.sync_every // p}, "
                          "so that one fragment's sync ends before the next one's starts")  # fmt: skip


OUTER_OPTIONS = (
    Option(name="sync_every", help=f"H, inner steps between two syncs of the (each) fragment (default {SYNC_EVERY})",
           default=SYNC_EVERY, check=Integer("sync_every", 1, 1 << 30)),
    Option(name="outer_lr", help=f"the outer optimizer's learning rate (default {OUTER_LR})", default=OUTER_LR,
           check=Number("outer_lr", 0.0, 100.0)),
    Option(name="outer_momentum", help=f"the outer optimizer's Nesterov momentum, 0 for none (default {OUTER_MOMENTUM})",
           default=OUTER_MOMENTUM, check=Number("outer_momentum", 0.0, 0.999)),
    Option(name="compress", help="how the pseudo-gradient travels: none (float32), bf16, int8 (a scale per 128 values) "
           "or fp4 (E3M0, a scale per 128 values); the lossy codes with error feedback, summed in float32 (default none)",
           default="none", choices=COMPRESSIONS),
)  # fmt: skip

DILOCO = Strategy(
    name="diloco", worker=diloco, replicas_differ=True, lockstep=True, check=check, options=OUTER_OPTIONS,
    paper="Douillard et al., DiLoCo, arXiv 2311.08105",
)  # fmt: skip

STREAMING = Strategy(
    name="streaming-diloco", worker=streaming, replicas_differ=True, lockstep=True, check=check,
    options=OUTER_OPTIONS + (
        Option(name="fragments", help=f"P, fragments synced in turn, one every H/P steps (default {FRAGMENTS})",
               default=FRAGMENTS, check=Integer("fragments", 1, 1 << 30)),
        Option(name="fragment_delay", help="tau, inner steps a fragment's sync overlaps, below H/P "
               f"(default {FRAGMENT_DELAY})", default=FRAGMENT_DELAY, check=Integer("fragment_delay", 0, 1 << 30)),
        Option(name="fragment_alpha", help="alpha, the share of the local fragment mixed into the synced one "
               f"(default {FRAGMENT_ALPHA})", default=FRAGMENT_ALPHA, check=Number("fragment_alpha", 0.0, 1.0)),
        Option(name="fragment_cut", help="slices (equal slices of the flat vector) or modules (whole modules, strided, "
               "as the paper and torchft cut them)", choices=CUTS),
    ),
    paper="Douillard et al., Streaming DiLoCo, arXiv 2501.18512",
)  # fmt: skip
