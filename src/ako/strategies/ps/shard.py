"""What the parameter-server strategies share: shards of the flat vector, pushing to and pulling
from the servers, a server's shard (`Shard`), the `--servers` option.

S servers each own a contiguous, size-balanced shard of the flat parameter vector (tensors kept
whole where the balance allows, as Ako's partitions are). A worker pushes each server the slice
of its gradient (or update) that server owns and pulls back the server's parameters
(docs/design.md, "The algorithms"; the workers' programs are in `workers`). Where the optimizer
runs:
- `bsp` and `absp` (synchronous: one mean per iteration): on the servers, which keep their
  shard's optimizer state (momentum buffer, Adam's moments) and schedule; the workers push gradients (`gradient_worker`).
- `ssp` and `asp` (stale): on the workers, as BytePS's asynchronous mode does: each worker takes
  its own optimizer step (momentum, Nesterov, weight decay) on its gradient and pushes the
  parameter delta; the servers add deltas (`update_worker`). A server-side momentum applied per
  push would take n momentum steps per clock on stale gradients ("asynchrony begets momentum",
  Mitliagkas et al. 2016), which diverges at ako's defaults.
- `easgd`: local SGD on the workers; the servers keep only the centre variable.

Messages: a push carries the worker's clock in `step` and, in `aux`, a few small integers
packed by `pack` (the stop vote, the version the gradient was computed on, sample counts).
A pull reply carries the server's version (updates applied so far) in `step` and, in `aux`,
1 when the worker must finish.
"""

from __future__ import annotations

import torch

from ako.checks import ConfigError, Integer, misfit
from ako.strategies.base import Option
from ako.strategies.ops import Recv, Send
from ako.strategies.partition import partition_bounds
from ako.strategies.tags import PS_REPLY, PS_PUSH


def shards(numel: int, boundaries: list[int], servers: int) -> list[tuple[int, int]]:
    """The [lo, hi) ranges of the flat vector (numel,) that each of `servers` servers owns."""
    return partition_bounds(numel, servers, boundaries)


def check(config, replica) -> None:
    """Raise ConfigError when there are more servers than parameters."""
    if config.servers is not None and config.servers > replica.numel:
        raise ConfigError(f"servers {config.servers}: must be at most the model's parameter count {replica.numel}")


def pack(*fields: tuple[int, int]) -> int:
    """Pack (value, bits) pairs into one non-negative integer, first field lowest."""
    out, shift = 0, 0
    for value, bits in fields:
        assert 0 <= value < 1 << bits, (value, bits)
        out |= value << shift
        shift += bits
    return out


def unpack(word: int, *bits: int) -> list[int]:
    """The fields `pack` packed, given their widths."""
    out = []
    for b in bits:
        out.append(word & ((1 << b) - 1))
        word >>= b
    return out


def push_shards(ctx, vector: torch.Tensor, step: int, aux: int):
    """Send each server its slice of `vector` (numel,) (copied: the caller may reuse it)."""
    for server, (lo, hi) in zip(ctx.servers, _bounds(ctx)):
        yield Send(vector[lo:hi].clone(), server, PS_PUSH, step, aux)


def pull_shards(ctx, into: torch.Tensor):
    """Receive every server's shard into `into` (numel,). Returns (version, finish): the
    lowest version any server reported, and whether any told this worker to finish."""
    version, finish = None, False
    for server, (lo, hi) in zip(ctx.servers, _bounds(ctx)):
        reply = yield Recv(PS_REPLY, server)
        into[lo:hi].copy_(reply.tensor)
        version = reply.step if version is None else min(version, reply.step)
        finish = finish or bool(reply.aux)
    return version, finish


def _bounds(ctx) -> list[tuple[int, int]]:
    return shards(ctx.replica.numel, ctx.replica.boundaries, len(ctx.servers))


class Shard:
    """A server's shard: `params` (hi - lo,) is a view of the server's replica vector, stepped
    by the server's own optimizer (`apply`) or moved by the workers' deltas (`add`); `version`
    counts the updates applied; staleness (in updates) of the gradients applied is tallied for
    the summary. A resumed run's shard starts from `sctx.restored` (its `state_dict`), and
    every update is reported to `sctx.on_update` (the runtime's checkpoints)."""

    def __init__(self, sctx):
        self.lo, self.hi = shards(sctx.replica.numel, sctx.replica.boundaries, len(sctx.servers))[sctx.index]
        self.params = sctx.replica.params[self.lo : self.hi]
        self.optimizer = sctx.replica.new_optimizer(self.params)  # the run's optimizer and schedule, on this shard
        self.version = self.resumed = 0
        self.staleness_sum = self.staleness_count = self.staleness_max = 0
        self.on_update = sctx.on_update
        if sctx.restored is not None:
            self.load_state_dict(sctx.restored)

    def apply(self, grad: torch.Tensor) -> None:
        """One optimizer step with `grad` (hi - lo,)."""
        self.optimizer.step(grad)
        self.updated()

    def add(self, delta: torch.Tensor, scale: float) -> None:
        """Move the parameters by `scale` x `delta` (hi - lo,): a worker's own update."""
        self.params.add_(delta, alpha=scale)
        self.updated()

    def updated(self) -> None:
        """Count an update of `params`, made by `apply` or by the server program itself."""
        self.version += 1
        self.on_update(self)

    def seen(self, version: int) -> int:
        """Tally the staleness of one gradient applied, computed on parameters of `version`,
        and return it (not known for the versions a worker held before a resume: not tallied,
        0 returned)."""
        if version < self.resumed:
            return 0
        staleness = self.version - version
        self.staleness_sum += staleness
        self.staleness_count += 1
        self.staleness_max = max(self.staleness_max, staleness)
        return staleness

    def reply(self, worker: int, finish: bool):
        """Send `worker` this shard's current parameters and whether it must finish."""
        yield Send(self.params.clone(), worker, PS_REPLY, self.version, int(finish))

    def state_dict(self) -> dict:
        """The shard's parameters, optimizer state, version and tallies, for a checkpoint."""
        return {
            "params": self.params.detach().cpu().clone(),
            "optimizer": self.optimizer.state_dict(),
            **{k: getattr(self, k) for k in ("version", "staleness_sum", "staleness_count", "staleness_max")},
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a checkpoint's `state_dict`. Raises ConfigError when it does not fit
        this shard (its size, the optimizer's parameter groups)."""
        try:
            self.params.copy_(state["params"])
            self.optimizer.load_state_dict(state["optimizer"])
            for key in ("version", "staleness_sum", "staleness_count", "staleness_max"):
                setattr(self, key, int(state[key]))
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
            raise misfit(f"checkpoint of the shard [{self.lo}, {self.hi})", e) from None
        self.resumed = self.version

    def facts(self) -> dict:
        return {
            "updates": self.version,
            "staleness_sum": self.staleness_sum,
            "staleness_count": self.staleness_count,
            "staleness_max": self.staleness_max,
        }


def staleness_summary(reports: list[dict]) -> dict:
    """Mean and maximum staleness of the applied gradients, over every server's tally."""
    servers = [r for r in reports if r["role"] == "server"]
    count = sum(r["staleness_count"] for r in servers)
    return {
        "staleness_mean": round(sum(r["staleness_sum"] for r in servers) / count, 4) if count else None,
        "staleness_max": max((r["staleness_max"] for r in servers), default=None),
    }


SERVERS = Option(name="servers", help="parameter-server processes beside the workers (default 1)", default=1,
                 check=Integer("servers", 1, 1024))  # fmt: skip
