"""The simulated runtime: the same worker and server programs, on a virtual-time cluster (SimPy).

Every rank (worker or server) is one SimPy process that drives its strategy program, carrying
out the operations of `ako.strategies.ops` as the distributed runtime does, with real tensors:
- `Compute` takes the next mini-batch, files the real gradient with the replica's parameters
  as they are at that virtual moment (`Gradients` computes every filed one together, as
  many at once as torch has threads, when the first is due), and holds the worker for the cost
  model's compute time (samples x seconds per sample x straggler factor, `costs.Costs`; on a
  shared host, its share of the cores, `costs.SharedHost`).
  `ComputePartial` does the same micro-batch by micro-batch, checking for the stop message
  between micro-batches.
- `Send` books the message on the sender's uplink and the receiver's downlink
  (`costs.Network`) and delivers it at the time the model gives; `Recv` waits for it, `Poll`
  takes what has been delivered. Messages are not copied: receivers of one `Send` tensor sent
  to several peers share it (the programs do not modify those).
- `AllReduce` waits for every worker, then reduces their tensors for real (in rank order) and
  resumes them all when the ring all-reduce's modelled time has passed. Each worker's k-th
  all-reduce joins the k-th collective; one started with `wait=False` resumes its worker at
  once, and `Wait` holds it until that collective is over. `ComputeAllReduce` is `Compute`
  and then such a collective, each bucket booked from when every worker had it ready.
- `MeasureStep`, `MeasureBandwidth` and `MeasureAllReduce` return the cost model's
  values; `Lost` is empty (no failures are simulated).
Evaluations (rank 0's snapshots, and where the replicas differ the consensus distance of
every worker's copy at the same step) take no virtual time. Same seed, same costs: same result, bit
for bit, as event order depends only on virtual times and the order events were made.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import simpy
import torch

from ako.runtime.base import compute, compute_all_reduce, compute_partial, drive
from ako.runtime.simulated.costs import Costs, Network, SharedHost
from ako.runtime.simulated.gradients import Gradients
from ako.runtime.simulated.progress import Progress
from ako.run.outcome import rank_report
from ako.run.worker import WorkerState
from ako.strategies import ops
from ako.strategies.tags import SNAPSHOT

class SimClock:
    """`ako.run.worker.Clock` on virtual time: seconds since the start of the simulation, frozen by
    `stop`. `pause` takes no virtual time; it tallies the real seconds spent in it
    (evaluations) in `paused_real`."""

    def __init__(self, env: simpy.Environment):
        self.env = env
        self.stopped: float | None = None
        self.paused_real = 0.0

    def begin(self) -> None:
        self.stopped = None

    def stop(self) -> None:
        self.stopped = self.env.now

    def now(self) -> float:
        return self.env.now if self.stopped is None else self.stopped

    wall = now  # virtual time has no evaluation pauses to leave out

    @contextmanager
    def pause(self):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.paused_real += time.perf_counter() - t


@dataclass
class Envelope:
    """A message in the simulated network, with the virtual time it was sent."""

    message: ops.Message
    sent_at: float


@dataclass
class Node:
    """One rank of the simulated cluster: its inbox (delivered messages by tag), the receive it
    is blocked on, its clock and time accounts (virtual seconds), and its program's result.
    `state` is None for a server."""

    rank: int
    clock: SimClock
    state: WorkerState | None = None
    inbox: dict[int, list[Envelope]] = field(default_factory=dict)
    waiting: tuple[int, int | None, simpy.Event] | None = None
    compute_seconds: float = 0.0
    idle_seconds: float = 0.0
    communication_seconds: float = 0.0
    facts: dict | None = None
    collectives: int = 0  # all-reduces this rank has started
    snapshot: tuple[torch.Tensor, int] | None = None  # the last `Publish`: (params, step)
    pullers: list[int] = field(default_factory=list)  # pulls that arrived before any `Publish`

    def take(self, tag: int, src: int | None = None) -> Envelope | None:
        """The first delivered message with `tag` (from `src`, or anyone), removed; or None."""
        queue = self.inbox.get(tag, [])
        for i, envelope in enumerate(queue):
            if src is None or envelope.message.src == src:
                return queue.pop(i)
        return None

    def take_all(self, tag: int) -> list[ops.Message]:
        """Every delivered message with `tag`, removed, in delivery order."""
        return [e.message for e in self.inbox.pop(tag, [])]

    def arrived(self, tag: int, step: int) -> bool:
        """Whether a delivered message with `tag` and a step >= `step` waits (left in place)."""
        return any(e.message.step >= step for e in self.inbox.get(tag, ()))

    def blocked(self, since: float, ready: float, until: float) -> None:
        """Account a wait from `since` to `until` for something that started moving on the
        network at `ready`: idle before it, communication after it."""
        ready = min(max(ready, since), until)
        self.idle_seconds += ready - since
        self.communication_seconds += until - ready


@dataclass
class _Collective:
    """An all-reduce being gathered: the members' tensors by rank, and the event that resumes
    them all. `arrived` and `end` are virtual times known once the last member is in."""

    done: simpy.Event
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)
    ready: dict[int, list[float]] = field(default_factory=dict)  # bucketed: each bucket's ready time, by rank
    arrived: float = 0.0
    end: float = 0.0


class SimulatedRuntime:
    """Carries out every rank's operations on one SimPy environment. Ranks below `workers` are
    workers, the rest servers. `batch_size` is what `MeasureStep` prices. The workers'
    gradients are computed `threads` at a time (`Gradients`)."""

    def __init__(self, env: simpy.Environment, costs: Costs, world: int, workers: int, batch_size: int, threads: int = 1):
        self.env, self.costs, self.workers, self.batch_size = env, costs, workers, batch_size
        self.gradients = Gradients(threads)
        self.progress: Progress | None = None  # the progress bar, counting every worker's steps
        self.network = Network(costs, world)
        self.host = SharedHost(env, costs) if costs.shared else None
        self.nodes = [Node(rank, SimClock(env)) for rank in range(world)]
        self.collectives: dict[int, _Collective] = {}  # by sequence number, until every worker is in
        self._bucket_plans: dict[int, tuple[list, list[float]]] = {}  # by bucket bytes: buckets, ready fractions

    @property
    def forward_backward(self) -> float:
        """Real seconds spent computing the workers' gradients."""
        return self.gradients.seconds

    def start(self, rank: int, program, ctx) -> None:
        """Start rank `rank`'s program `program(ctx)` as a SimPy process."""
        self.env.process(self._drive(self.nodes[rank], program(ctx)))

    def _drive(self, node: Node, gen):
        node.facts = yield from drive(gen, lambda op: self.execute(node, op))
        node.clock.stop()

    def execute(self, node: Node, op):
        """Carry out one operation for `node` (a SimPy sub-process: `yield from` it); returns
        its result. Operations that take no virtual time return without yielding."""
        match op:
            case ops.Compute():
                gradient = yield from compute(node.state, lambda batches, samples, slow: self._gradient(node, batches, samples, slow))
                return self._stepped(gradient)
            case ops.ComputeAllReduce(bucket_bytes):
                gradient = yield from compute_all_reduce(node.state, lambda batches, samples, slow: self._gradient_reduced(node, batches, samples, slow, bucket_bytes))
                return self._stepped(gradient)
            case ops.ComputePartial(micro_batch, stop_tag, stop_step, late_share):
                return self._stepped((yield from compute_partial(
                    node.state, lambda batches, samples, slow: self._gradient(node, batches, samples, slow),
                    node.arrived, micro_batch, stop_tag, stop_step, late_share,
                )))  # fmt: skip
            case ops.Send(tensor, dst, tag, step, aux):
                self.send(node.rank, dst, ops.Message(node.rank, tag, step, aux, tensor))
                return None
            case ops.Recv(tag, src):
                return (yield from self.receive(node, tag, src))
            case ops.Poll(tag):
                return node.take_all(tag)
            case ops.AllReduce(tensor, reduce, wait):
                collective = self.start_all_reduce(node, tensor, reduce)
                return (yield from self.wait(node, collective)) if wait else collective
            case ops.Wait(collective):
                return (yield from self.wait(node, collective))
            case ops.Publish(tensor, step):
                node.snapshot = (tensor.detach().clone(), step)
                for puller in node.pullers:
                    self._answer_pull(node, puller)
                node.pullers.clear()
                return None
            case ops.Pull(src):
                return (yield from self.pull(node, src))
            case ops.Lost():
                return frozenset()
            case ops.MeasureStep():
                return self.costs.compute_seconds(self.batch_size)
            case ops.MeasureBandwidth():
                return self.costs.bandwidth
            case ops.MeasureAllReduce(nbytes):
                return self.costs.ring_allreduce_seconds(nbytes, self.workers)
        raise TypeError(f"unknown operation {op!r}")

    def _stepped(self, gradient):
        if self.progress is not None:
            self.progress.step()
        return gradient

    def _gradient(self, node: Node, batches: list, samples: int, slow: float):
        """File the real gradient of one step's micro-batches into `node`'s replica (computed
        with every other one filed when the first is due, `Gradients`), and hold `node` for the
        modelled compute time of `samples` samples. Returns the loss."""
        filed = self.gradients.file(node.state.replica, batches)
        yield from self._busy(node, samples, slow)
        return self.gradients.take(filed)

    def _gradient_reduced(self, node: Node, batches: list, samples: int, slow: float, bucket_bytes: int):
        """`_gradient`, then the sum over every worker by bucketed all-reduces that overlap
        backward (`ops.ComputeAllReduce`; their times in `costs` module docstring)."""
        replica = node.state.replica
        start = self.env.now
        loss = yield from self._gradient(node, batches, samples, slow)
        if bucket_bytes not in self._bucket_plans:
            buckets = replica.buckets(bucket_bytes)
            self._bucket_plans[bucket_bytes] = (buckets, self.costs.bucket_ready(replica.boundaries, buckets))
        buckets, ready = self._bucket_plans[bucket_bytes]
        span = self.env.now - start
        c = self.start_all_reduce(node, replica.grad_and_slot, "sum", (buckets, [start + span * f for f in ready]))
        yield from self.wait(node, c)
        return loss

    def _busy(self, node: Node, samples: int, slow: float):
        """Hold `node` for the compute time of `samples` samples at straggler factor `slow`."""
        if self.host is None:
            seconds = self.costs.compute_seconds(samples, slow)
            node.compute_seconds += seconds
            yield self.env.timeout(seconds)
            return
        start = self.env.now
        yield self.host.compute(samples)
        yield self.env.timeout((slow - 1.0) * (self.env.now - start))
        node.compute_seconds += self.env.now - start

    def send(self, src: int, dst: int, message: ops.Message) -> None:
        """Book `message` on the network and deliver it to `dst` when the model says."""
        nbytes = message.tensor.numel() * message.tensor.element_size()
        arrival = self.network.transmit(self.env.now, src, dst, nbytes)
        envelope = Envelope(message, self.env.now)
        self.env.timeout(arrival - self.env.now).callbacks.append(lambda _: self._deliver(self.nodes[dst], envelope))

    def _deliver(self, node: Node, envelope: Envelope) -> None:
        m = envelope.message
        if node.waiting is not None:
            tag, src, event = node.waiting
            if tag == m.tag and (src is None or src == m.src):
                node.waiting = None
                event.succeed(envelope)
                return
        node.inbox.setdefault(m.tag, []).append(envelope)

    def pull(self, node: Node, src: int):
        """`ops.Pull`: a request (an empty message) to `src`, answered on arrival with the
        snapshot `src` has published by then (or at its first publish), as one message back."""
        arrival = self.network.transmit(self.env.now, node.rank, src, 0)
        self.env.timeout(arrival - self.env.now).callbacks.append(lambda _: self._request_arrived(src, node.rank))
        m = yield from self.receive(node, SNAPSHOT, src)
        return ops.Snapshot(src, m.step, m.tensor.clone())

    def _request_arrived(self, src: int, puller: int) -> None:
        node = self.nodes[src]
        if node.snapshot is None:
            node.pullers.append(puller)
        else:
            self._answer_pull(node, puller)

    def _answer_pull(self, node: Node, puller: int) -> None:
        tensor, step = node.snapshot
        self.send(node.rank, puller, ops.Message(node.rank, SNAPSHOT, step, 0, tensor))

    def receive(self, node: Node, tag: int, src: int | None):
        """The next message with `tag` (from `src` or anyone), waiting for it if need be."""
        envelope = node.take(tag, src)
        if envelope is None:
            since, event = self.env.now, self.env.event()
            node.waiting = (tag, src, event)
            envelope = yield event
            node.blocked(since, envelope.sent_at, self.env.now)
        return envelope.message

    def start_all_reduce(self, node: Node, tensor: torch.Tensor, reduce: str, buckets=None) -> _Collective:
        """Join `node`'s next collective with `tensor`. When every worker is in, reduce their
        tensors in rank order into each of them and book the ring all-reduce
        (`Network.all_reduce`), whose end fires the collective's `done`. `buckets`: ([lo, hi)
        ranges, the virtual time each was ready on `node`), for all-reduces that overlapped
        backward: each range is booked, in order, from the last member's ready time."""
        seq, node.collectives = node.collectives, node.collectives + 1
        c = self.collectives.setdefault(seq, _Collective(self.env.event()))
        c.tensors[node.rank] = tensor
        if buckets is not None:
            c.ready[node.rank] = buckets[1]
        if len(c.tensors) == self.workers:
            del self.collectives[seq]
            members = sorted(c.tensors)
            self._reduce([c.tensors[r] for r in members], reduce)
            size = tensor.element_size()
            spans = [(0, tensor.numel(), self.env.now)] if buckets is None else [
                (lo, hi, max(c.ready[r][j] for r in members)) for j, (lo, hi) in enumerate(buckets[0])
            ]  # fmt: skip
            c.end = self.env.now
            for lo, hi, at in spans:
                c.end = max(c.end, self.network.all_reduce(at, members, (hi - lo) * size)[1])
            c.arrived = self.env.now
            self.env.timeout(c.end - self.env.now).callbacks.append(lambda _: c.done.succeed())
        return c

    def wait(self, node: Node, c: _Collective):
        """Hold `node` until collective `c` is over; returns its tensor."""
        since = self.env.now
        if not c.done.processed:
            yield c.done
            node.blocked(since, c.arrived, c.end)
        return c.tensors[node.rank]

    @staticmethod
    def _reduce(tensors: list[torch.Tensor], reduce: str) -> None:
        total = tensors[0].clone()
        for t in tensors[1:]:
            if reduce == "sum":
                total.add_(t)
            else:
                torch.maximum(total, t, out=total)
        for t in tensors:
            t.copy_(total)

    def request_stop(self, rank: int) -> None:
        """Rank `rank` reached the target: every other worker hears it one latency later."""
        def tell(_):
            for node in self.nodes[: self.workers]:
                if node.state is not None:
                    node.state.stop_requested = True

        self.env.timeout(self.costs.latency).callbacks.append(tell)

    def run(self) -> None:
        """Run the simulation until every program has ended. Raises RuntimeError when some
        wait for ever (a deadlock: no events left)."""
        self.env.run()
        stuck = [n for n in self.nodes if n.facts is None]
        if stuck:
            what = ", ".join(
                f"rank {n.rank} waits for tag {n.waiting[0]}" if n.waiting else f"rank {n.rank} in a collective"
                for n in stuck
            )
            raise RuntimeError(f"the simulation deadlocked at {self.env.now:.6f} s: {what}")

    def traffic(self, rank: int) -> tuple[int, int]:
        """(sent, received) bytes of rank `rank` so far, messages plus collectives."""
        nic = self.network.nics[rank]
        return nic.bytes_up, nic.bytes_down

    def node_report(self, rank: int, end: float) -> dict:
        """Rank `rank`'s report for the summary (as `DistributedRuntime.gather_reports` gathers them),
        with its time accounts and NIC utilisation over `end` virtual seconds."""
        node, nic = self.nodes[rank], self.network.nics[rank]
        span = max(end, 1e-12)
        return {
            **rank_report(rank, node.state, node.facts, nic.bytes_up, nic.bytes_down),
            "compute_seconds": round(node.compute_seconds, 6),
            "idle_seconds": round(node.idle_seconds, 6),
            "communication_seconds": round(node.communication_seconds, 6),
            "uplink_utilisation": round(min(1.0, nic.up_busy / span), 4),
            "downlink_utilisation": round(min(1.0, nic.down_busy / span), 4),
        }
