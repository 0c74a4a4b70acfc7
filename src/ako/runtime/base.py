"""What both runtimes share: the loop that drives a strategy program, and a worker's computation.

A strategy program is a generator of operations (`ako.strategies.ops`). A runtime carries each
one out with its `execute(op)`, itself a generator: the simulator yields the SimPy events it
waits on (virtual time passes), while the distributed runtime blocks in real time and never
yields. `drive` is the one loop between the two; `run_blocking` runs it on real processes.

`compute` and `compute_partial` are a worker's computation, written once. A runtime gives them
`gradient(batches, samples, slow)`, a generator that computes the real gradient of one step's
micro-batches (`samples` in all) into the replica's buffer and lets their time pass (a
straggler's `slow` times more), and, for `ComputePartial`, `arrived(tag, step)`: whether a
message with `tag` and a step >= `step` is in the worker's inbox (left there).
"""

from __future__ import annotations

from collections.abc import Callable, Generator

import torch

from ako.data import fetch
from ako.strategies.ops import Gradient, PartialGradient, PeerLost, ReducedGradient

GradientFn = Callable[[list, int, float], Generator]


def drive(program: Generator, execute: Callable[[object], Generator]) -> Generator:
    """Run `program` to its end, carrying out each operation it yields with `execute`; returns
    the program's facts (its return value, or {}). A `PeerLost` from `execute` is thrown into
    the program at the operation that met it, so that it may carry on without the peer."""
    result, lost = None, None
    while True:
        try:
            op = program.send(result) if lost is None else program.throw(lost)
        except StopIteration as done:
            return done.value or {}
        try:
            result, lost = (yield from execute(op)), None
        except PeerLost as e:
            result, lost = None, e


def run_blocking(gen: Generator):
    """The return value of `gen`, a `drive` whose operations all block instead of yielding."""
    try:
        next(gen)
    except StopIteration as done:
        return done.value
    raise RuntimeError("an operation of a blocking runtime yielded")


def straggler_factor(state) -> float:
    """How many times slower than its compute this worker is at this step (1 unless a
    straggler; `ako.cluster.Slowdown`)."""
    return state.slowdown.factor() if state.slowdown.active else 1.0


def compute(state, gradient: GradientFn) -> Generator:
    """`ops.Compute`: what is due between two steps (`WorkerState.before_step`: checkpoint,
    evaluation), then forward and backward on the worker's next mini-batch. Returns a
    `Gradient` whose `grad` (numel,) is the replica's buffer."""
    state.before_step()
    batches = state.cursor.next_batch()
    samples = state.cursor.batch_size
    loss = yield from gradient(batches, samples, straggler_factor(state))
    state.computed(loss)
    return Gradient(state.replica.grad, loss, samples)


def compute_all_reduce(state, gradient: GradientFn) -> Generator:
    """`ops.ComputeAllReduce`: `compute`, with the stop vote (once this step's mini-batch is
    taken) in the replica's slot; `gradient` also sums the gradient and the slot over every
    worker. Returns a `ReducedGradient`."""

    def voted(batches: list, samples: int, slow: float):
        state.replica.slot.fill_(float(state.should_stop()))
        return (yield from gradient(batches, samples, slow))

    g = yield from compute(state, voted)
    return ReducedGradient(g.grad, g.loss, g.samples, stopping=round(state.replica.slot.item()))


def compute_partial(
    state, gradient: GradientFn, arrived: Callable[[int, int], bool], micro_batch: int, stop_tag: int, stop_step: int | None,
    late_share: float = 0.0,
) -> Generator:  # fmt: skip
    """`ops.ComputePartial`, A-BSP's interruptible computation (Wang et al. 2018, section 3):
    the assignment micro-batch by micro-batch, stopping before the next one once a message
    `stop_tag` of a step >= `stop_step` has come (None: after the first), while more than
    `late_share` of the assignment is left (less is timing noise, not a straggler). Returns a
    `PartialGradient` of the sum (numel,) of the per-sample gradients done; the samples not
    done wait for the next step."""
    state.before_step()
    indices, since = state.cursor.next_assignment()
    slow = straggler_factor(state)
    grad_sum = torch.zeros_like(state.replica.grad)
    done, loss_sum = 0, 0.0
    for chunk in indices.split(micro_batch):
        late = len(indices) - done > late_share * len(indices)
        if done and late and (stop_step is None or arrived(stop_tag, stop_step)):
            break
        batch = fetch(state.cursor.train_set, chunk, state.cursor.collate_fn)
        loss_sum += (yield from gradient([batch], len(chunk), slow)) * len(chunk)
        grad_sum.add_(state.replica.grad, alpha=len(chunk))
        done += len(chunk)
    oldest = state.cursor.processed(indices, since, done)
    state.computed(loss_sum / done)
    return PartialGradient(grad_sum, loss_sum / done, done, indices, oldest)
