"""The operations a strategy program yields to its runtime (docs/design.md, "The strategy
programming model").

A strategy is a generator function `worker(ctx)` that yields these operations and receives their
results, like a SimPy process. The distributed runtime carries them out on torch.distributed; the
simulated runtime carries out the same math and charges their time from a cost model. Anything
that costs time or crosses the network is an operation; updating the replica is plain tensor code.

An operation that meets a dead peer raises `PeerLost` inside the program, at the `yield`: the
program may catch it, and if it does not, the worker fails with it. Other errors (a timeout)
fail the worker.

Tensors handed to `AllReduce` are flat, contiguous float32 vectors; those handed to `Send`
are flat and contiguous, float32 or uint8 (a compressed payload, `compress.py`). After a `Send`
the runtime owns the tensor until it is delivered: the program must not modify it (send a clone
of a buffer it keeps using). A received tensor may be modified in place only when its sender
sent it to that receiver alone: the simulated runtime does not copy messages, so the receivers
of one tensor sent to several peers share it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class Compute:
    """Forward and backward on the worker's next mini-batch, with the replica's parameters as
    they are when the operation starts. Result: `Gradient`."""


@dataclass(frozen=True)
class ComputeAllReduce:
    """`Compute` whose gradient is summed over all workers by all-reduces that overlap backward,
    as DistributedDataParallel's reducer does (Li et al., "PyTorch Distributed", VLDB 2020,
    section 3.2.3): the flat gradient is cut into buckets of whole parameter tensors of
    `bucket_bytes` or a little more (`Replica.buckets`), and each bucket's all-reduce starts as soon as backward
    has finished its gradients, while backward goes on with the rest. Every worker must yield it
    at the same point of its program (it is a collective). Result: `ReducedGradient`.

    Simulated runtime: bucket j's gradient is ready at the fraction `Costs.bucket_ready` gives of the
    worker's compute time, and its ring all-reduce is booked from when the last worker had it
    ready (and the links were free)."""

    bucket_bytes: int = 256 << 10


@dataclass(frozen=True)
class Gradient:
    """Result of `Compute`: `grad` (numel,) is the replica's gradient buffer, valid until the
    next `Compute`; `loss` is the mini-batch mean loss; `samples` the mini-batch size."""

    grad: torch.Tensor
    loss: float
    samples: int


@dataclass(frozen=True)
class ReducedGradient(Gradient):
    """Result of `ComputeAllReduce`: `grad` (numel,) is the SUM of every worker's gradient
    (`loss` and `samples` stay this worker's own); `stopping` is how many workers were
    stopping (`WorkerContext.stopping`) when their computation began: the stop vote, which
    rides in the first bucket, so that synchronous workers agree on their last step at no
    cost."""

    stopping: int = 0


@dataclass(frozen=True)
class ComputePartial:
    """A-BSP's interruptible computation (Wang et al., Middleware 2018): work through this
    step's assignment (the samples left over from last time first, then fresh ones, up to a
    mini-batch) in micro-batches of `micro_batch` samples, and stop early, after the current
    micro-batch, once a message with `stop_tag` and step >= `stop_step` has arrived (it stays
    in the inbox, to be received as usual); `stop_step` None: after the first micro-batch (the
    program knows already). At least one micro-batch is always processed. Result:
    `PartialGradient`; the samples not processed go first next time, by this operation or by
    `Compute`. `late_share`: a stop cuts the assignment only while more than this share of it
    is left (A-BSP: a worker counts as late only beyond that margin, not for timing noise)."""

    micro_batch: int
    stop_tag: int
    stop_step: int | None
    late_share: float = 0.0


@dataclass(frozen=True)
class PartialGradient:
    """Result of `ComputePartial`: `grad_sum` (numel,) is the SUM of the per-sample gradients
    of the first `samples` of the assignment `indices` (int64 (assigned,), data set indices);
    `loss` the mean loss of those; `oldest` the age in iterations of the oldest sample still
    waiting (0 when none waits)."""

    grad_sum: torch.Tensor
    loss: float
    samples: int
    indices: torch.Tensor
    oldest: int

    @property
    def assigned(self) -> int:
        return len(self.indices)


@dataclass(frozen=True)
class Send:
    """Send `tensor` to worker `dst` without waiting. `tag` (>= 0) selects the receiver's queue;
    `step` and `aux` are two integers that travel in the message header. Result: None."""

    tensor: torch.Tensor
    dst: int
    tag: int
    step: int = 0
    aux: int = 0


@dataclass(frozen=True)
class Message:
    """A received message: sender rank, tag, the sender's `step` and `aux`, and the payload."""

    src: int
    tag: int
    step: int
    aux: int
    tensor: torch.Tensor


@dataclass(frozen=True)
class Recv:
    """Wait for the next message with `tag` (from `src`, or from anyone when None). Result:
    `Message`. The wait lasts as long as `src` shows signs of life; from anyone, as long as one
    of `awaiting` (the peers whose messages it is for) does, or, without them, for the run's
    timeout. Raises `PeerLost` when the awaited peer is gone (for any source: when any peer is
    gone, or, if the strategy survives losses, once for each peer whose loss neither an earlier
    `Recv` nor `Lost` has reported; an awaited peer that stays silent for the timeout is lost)."""

    tag: int
    src: int | None = None
    awaiting: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Poll:
    """Take every message with `tag` that has arrived, without waiting. Result: list[Message].
    Raises `PeerLost` when a peer is gone, unless the strategy survives losses."""

    tag: int


@dataclass(frozen=True)
class Publish:
    """Make a copy of `tensor` (flat, float32, (numel,)) this worker's published snapshot,
    replacing the previous one; `step` travels with it. The runtime answers peers' `Pull`s
    with the latest snapshot by itself, while this program goes on training: publishing never
    waits, and being pulled from costs the program nothing. Result: None.

    Distributed runtime: a receive thread answers each pull request with an `isend`. A
    simulated runtime: the snapshot current when a request arrives, charged as one message."""

    tensor: torch.Tensor
    step: int = 0


@dataclass(frozen=True)
class Pull:
    """Ask worker `src` for its latest published snapshot and wait for the answer, up to the
    run's timeout. A request that reaches `src` before its first `Publish` is answered at that
    publish. `src` answers as long as its program runs (a strategy that pulls ends with a
    handshake, so that no peer pulls from a worker that has finished). Result: `Snapshot`.
    Raises `PeerLost` when `src` is dead or dies before answering; the worker fails with
    TimeoutError when `src` does not answer within the timeout."""

    src: int


@dataclass(frozen=True)
class Snapshot:
    """Result of `Pull`: `tensor` (numel,) is a copy of worker `src`'s parameters as it
    published them after its step `step`; the program may keep and modify it."""

    src: int
    step: int
    tensor: torch.Tensor


@dataclass(frozen=True)
class AllReduce:
    """Reduce `tensor` over all workers, in place ("sum" or "max"). Result: the tensor.

    With `wait=False` the program goes on at once and the result is a handle for `Wait`; the
    tensor must not be touched until then. Every worker must start its collectives in the same
    order; several may be in flight at once (they complete in the order they were started)."""

    tensor: torch.Tensor
    op: Literal["sum", "max"] = "sum"
    wait: bool = True


@dataclass(frozen=True)
class Wait:
    """Wait for the all-reduce that `AllReduce(..., wait=False)` returned `handle` for, up to
    the run's timeout. Result: its tensor, reduced."""

    handle: object


@dataclass(frozen=True)
class Lost:
    """Result: the frozenset of peer ranks known to be dead (for strategies that survive losses;
    a `Send` to a dead peer is dropped). Counts as reporting those losses (see `Recv`)."""


@dataclass(frozen=True)
class MeasureStep:
    """Result: seconds one `Compute` takes on this worker (measured, or from the cost model)."""


@dataclass(frozen=True)
class MeasureBandwidth:
    """Result: bytes per second this worker's link carries (measured, or from the cost model).
    `probe_bytes`: what a measurement sends (the strategies give their gradient's bytes, so
    the probe costs about what an exchange does)."""

    probe_bytes: int


@dataclass(frozen=True)
class MeasureAllReduce:
    """Result: seconds one all-reduce of `nbytes` bytes takes over every worker, from a common
    start, the slowest worker's (measured with a float32 tensor of that size, or the cost
    model's ring formula, latency included). Every worker must ask it at the same point."""

    nbytes: int


class PeerLost(RuntimeError):
    """A peer died, disconnected or was dropped for its silence; `rank` names it, `role`
    ("worker" or "server") says what it was."""

    def __init__(self, rank: int, reason: str, role: str = "worker"):
        super().__init__(f"lost {role} rank {rank}: {reason}")
        self.rank = rank
