"""The third driver: a user's own training loop drives a strategy program (docs/design.md,
"Your own training loop").

`ako train` and `ako simulate` own the batch: their runtimes answer `ops.Compute` with forward
and backward on the next mini-batch. Here the user's loop computes the gradient itself, and
`optimizer.step()` answers the `Compute` (or `ComputeAllReduce`) the program is waiting on. The
program is run by the same `runtime.base.drive` as on the other runtimes, with an `execute`
that passes every other operation (messages, collectives, pulls) to a `DistributedRuntime` and
hands the compute points back out of the generator to this driver, the way the simulator's
execute yields SimPy events. Between two calls of `step` the program is suspended at its
next compute point, so the user's forward and backward run with the parameters as the
program left them, exactly as they would under `ako train`.

`ComputeAllReduce` (allreduce) reduces the gradient while the user's backward runs, as DDP's
reducer does: the replica's post-accumulate-grad hooks start each bucket's all-reduce once its
tensors are done, and the end of backward waits for them. Each bucket is divided by n before
its all-reduce, so after backward `.grad` holds the mean over workers (what DDP users clip);
a second backward before the step (gradient accumulation without `no_sync`) reduces again,
and the mean of (mean + own) is mean + mean of own: correct, at the cost of the traffic.

The end: the loop cannot know its last step in advance, and a program decides whether to stop
after a step (`ctx.stopping`). `finish` answers the compute points that follow with a zero
gradient and no optimizer step (`UserOptimizer.skip`), with `stopping` true, until the program
returns: the allreduce's last vote, Ako's flush, gossip's handshake, EASGD's last push run as
under `ako train`; the extra round moves no parameter by a gradient.

What needs ako to own the batch is off: a straggler's partial steps (Ako's, A-BSP's) and the
measurement of a step's compute, which is the time between two calls of `step` instead.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch

from ako.cluster import Slowdown
from ako.runtime.base import drive
from ako.runtime.distributed.runtime import DistributedRuntime, _Buckets
from ako.strategies.ops import Compute, ComputeAllReduce, ComputePartial, Gradient, MeasureStep, ReducedGradient

COMPUTE_POINTS = (Compute, ComputeAllReduce, MeasureStep)  # the operations the user's loop answers


class UserOptimizer:
    """The user's torch optimizer, in the place of `optim.FlatOptimizer` in a `Replica`: a
    program's `replica.step(grad)` puts `grad` (numel,) into the parameters' `.grad` (views of
    the replica's flat gradient) and calls the optimizer's own `step` (`user_step`). `skip`: the
    steps of `finish`'s last round are not taken. The user steps the schedule, if any."""

    def __init__(self, grad: torch.Tensor, user_step: Callable[[], object], optimizer: torch.optim.Optimizer):
        self.grad, self.user_step, self.optimizer = grad, user_step, optimizer
        self.steps = 0
        self.skip = False

    def step(self, grad: torch.Tensor) -> None:
        if grad.data_ptr() != self.grad.data_ptr():
            self.grad.copy_(grad)
        if self.skip:
            return
        self.user_step()
        self.steps += 1

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state.get("steps", 0))


class NoOptimizer:
    """A parameter server's shard optimizer in a user's loop: the user's optimizer lives on the
    workers, so a strategy whose servers step one (bsp, absp) cannot run (refused before)."""

    def step(self, grad: torch.Tensor) -> None:
        raise RuntimeError("a server cannot step the user's optimizer (bsp and absp run in ako train only)")


class UserOptimization:
    """`optim.Optimization`'s part a `Replica` uses: `build(params)` gives the user's optimizer
    for the replica's whole vector (`UserOptimizer`), and `NoOptimizer` for a server's shard."""

    def __init__(self, optimizer: torch.optim.Optimizer, user_step: Callable[[], object]):
        self.optimizer, self.user_step = optimizer, user_step
        self.built: UserOptimizer | None = None

    def build(self, params: torch.Tensor):
        if self.built is None:
            self.built = UserOptimizer(params, self.user_step, self.optimizer)  # `grad`: the replica's, set once it is made
            return self.built
        return NoOptimizer()


class LoopDriver:
    """Drives worker program `program(ctx)` from the user's loop: `step()` after each backward
    (the user's `optimizer.step()`), `finish()` at the end. `runtime` carries out every other
    operation; `replica` is the user's model as a `Replica` (its optimizer a `UserOptimizer`).
    `slowdown` emulates a straggler (`--straggler`): after the user's compute, a sleep of
    (k - 1) times its duration. `on_step(steps)` is called after each step (the metrics).

    Raises from `step` and `finish` what the program raises: `PeerLost`, a timeout, a failed
    collective (the caller reports it in one line)."""

    def __init__(self, runtime: DistributedRuntime, program, ctx, replica, slowdown: Slowdown | None = None,
                 on_step: Callable[[int], None] = lambda steps: None):  # fmt: skip
        self.runtime, self.replica, self.ctx = runtime, replica, ctx
        self.slowdown, self.on_step = slowdown, on_step
        self.n = ctx.world_size
        self.finishing = False
        self.steps = 0
        self.facts: dict | None = None
        self.pending = None  # the compute point the program waits on, None once it has returned
        self.buckets: _Buckets | None = None
        self.reduced = False  # a backward reduced the gradient since the program reached its ComputeAllReduce
        self.in_backward = False
        self.sync = True  # False inside `no_sync` (gradient accumulation): backward reduces nothing
        self.wants_sync: Callable[[], bool] = lambda: True  # the caller's say too (nanoGPT's require_backward_grad_sync)
        # runs the collectives started inside the user's backward (the caller's one-line failure)
        self.guard: Callable[[Callable], object] = lambda fn: fn()
        self.last = time.perf_counter()  # when the user's loop last got control back
        self.tensors = [p for p in replica.model.parameters() if p.requires_grad]  # as the replica orders them
        self.views = [p.grad for p in self.tensors]  # views of the replica's flat gradient
        replica._ready = self._tensor_done
        self._program = drive(program(ctx), self._execute)
        self._advance(None)

    def _execute(self, op):
        if isinstance(op, COMPUTE_POINTS):
            self.runtime.first_step()
            return (yield op)  # suspended: the user's loop computes, `step` or `finish` answers
        if isinstance(op, ComputePartial):
            raise RuntimeError("a partial step needs ako to own the batch: off in your own loop")
        return (yield from self.runtime.execute(op))

    def _advance(self, answer) -> None:
        try:
            self.pending = self._program.send(answer)
        except StopIteration as done:
            self.pending, self.facts = None, done.value or {}
            return
        if isinstance(self.pending, ComputeAllReduce) and not self.finishing:
            self._arm(self.pending.bucket_bytes)

    # --- all-reduce during the user's backward -------------------------------------------

    def _arm(self, bucket_bytes: int) -> None:
        if self.buckets is None:
            self.buckets = _Buckets(self.runtime, self.replica, bucket_bytes)
            self.buckets.prescale = 1.0 / self.n
        self.buckets.begin(self._vote)
        self.reduced = False

    def _vote(self) -> None:
        """Before each bucket's all-reduce: the stop vote in the slot (1 while finishing), so
        that it reads the same whichever bucket holds it, however often backward runs."""
        self.replica.slot.fill_(float(self.finishing))

    def _tensor_done(self, i: int) -> None:
        """A parameter tensor's gradient is final for this backward (the replica's hook). A
        gradient set to None since (`p.grad = None`) came back as a tensor of its own: it goes
        into the flat gradient again."""
        param, view = self.tensors[i], self.views[i]
        if param.grad is not view:
            view.copy_(param.grad)
            param.grad = view
        if not (self.sync and self.wants_sync() and isinstance(self.pending, ComputeAllReduce) and not self.finishing):
            return
        if not self.in_backward:
            self.in_backward = True
            if self.reduced:  # a second backward before the step: reduce its buckets again
                self.buckets.begin(self._vote)
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        self.guard(lambda: self.buckets.ready(i))

    def _backward_done(self) -> None:
        """The end of a backward: start the buckets it did not reach (unused parameters) and
        wait for them all."""
        self.in_backward = False
        self.guard(self.buckets.finish)
        self.reduced = True

    def _reduced_gradient(self) -> ReducedGradient:
        """The program's `ReducedGradient`: the SUM over workers, from the mean the buckets hold."""
        if not self.reduced:  # no backward reduced it (all under `no_sync`, or finishing): now
            self.buckets.begin(self._vote)
            self.buckets.finish()
        stopping = round(self.replica.slot.item() * self.n)
        self.reduced = False
        return ReducedGradient(self.replica.grad.mul_(self.n), math.nan, 0, stopping=stopping)

    @contextmanager
    def no_sync(self):
        """Backward inside reduces nothing (DDP's `no_sync`): the gradients accumulate, and the
        next backward outside (or the step) reduces the sum."""
        before, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = before

    # --- the user's loop --------------------------------------------------------------------

    def step(self) -> None:
        """The user's `optimizer.step()`: answer the program's compute point with the gradient
        in `.grad`, and run the program to its next one (its optimizer step and exchange)."""
        if self.pending is None:
            raise RuntimeError(f"the {self.ctx.config.strategy} program has ended (another worker finished its "
                               "loop first, or finish() was called): no more steps")  # fmt: skip
        computed = time.perf_counter() - self.last
        if self.slowdown is not None and self.slowdown.active:
            time.sleep((self.slowdown.factor() - 1.0) * computed)
        answered = False
        while self.pending is not None and not answered:
            op = self.pending
            if isinstance(op, MeasureStep):
                answer = computed  # this step's gradient then answers the Compute that follows
            else:
                answer, answered = self._gradient(op), True
            self._advance(answer)
        self.steps += 1
        self.on_step(self.steps)
        self.last = time.perf_counter()

    def _gradient(self, op):
        if isinstance(op, ComputeAllReduce):
            return self._reduced_gradient()
        return Gradient(self.replica.grad, math.nan, 0)

    def finish(self) -> dict:
        """The loop is over: answer the compute points with a zero gradient and no step, with
        `stopping` true, until the program returns (its flush, handshake or last push). Returns
        the program's facts."""
        self.finishing = True
        self.replica.optimizer.skip = True
        while self.pending is not None:
            op = self.pending
            if isinstance(op, MeasureStep):
                answer = max(time.perf_counter() - self.last, 1e-3)  # no step at all: a stand-in
            else:
                self.replica.grad.zero_()
                if isinstance(op, ComputeAllReduce) and self.buckets is None:
                    self._arm(op.bucket_bytes)
                answer = self._gradient(op)
            self._advance(answer)
        return self.facts
