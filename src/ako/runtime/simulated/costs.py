"""The simulated runtime's cost model (docs/design.md, "Cluster model"): compute speed, NICs, links.

- Compute: a gradient of k samples takes k x `seconds_per_sample` x the straggler factor that
  `ako.cluster.Slowdown` gives for that step (the same description the distributed runtime uses).
- Network: every node (worker or server) has one NIC on a non-blocking switch, with an uplink
  and a downlink of `bandwidth` bytes/s each. Each link is a FIFO: a message is transmitted
  whole, in the order it was sent, at the full link rate (no fair sharing). A message of b
  bytes from s to d starts on s's uplink when that is free, and passes cut-through onto d's
  downlink when that is free as well (the switch buffers it meanwhile; no back-pressure on the
  sender), so
      up_start   = max(now, uplink_free[s]),           uplink_free[s] = up_start + b / B
      down_end   = max(up_start, downlink_free[d]) + b / B = downlink_free[d]
      delivered  = down_end + latency
  One message alone thus takes b / B + latency. Contention at a busy node (a parameter server
  receiving n pushes) is messages queueing on its downlink: it emerges from the model.
- All-reduce: the ring formula 2 (n-1)/n x bytes / B + 2 (n-1) x latency (reduce-scatter then
  all-gather, n-1 steps each, every node sending and receiving 1/n of the tensor per step),
  from the moment the last worker arrives and every member's links are free; it holds every
  member's uplink and downlink for the transfer, 2 (n-1)/n x bytes / B (the links are free
  while a hop's latency passes, so all-reduces in flight at once pipeline).
- All-reduce overlapping backward (`ops.ComputeAllReduce`): bucket j's gradient is final at
  start + fraction_j x the worker's compute time, fraction_j the largest of its tensors'
  `gradient_ready` fractions (measured by `ako calibrate`; without them, forward takes the first
  third and backward finishes the tensors last-first at equal intervals over the rest). Each
  bucket's ring all-reduce is booked, in order, from the latest of the members' ready times.
A bandwidth of infinity makes transfers free (latency still counts).
- Shared host (optional, `Costs.shared`): every worker runs on one machine, as `ako train`
  runs them locally, and the computations running at once share its cores by processor
  sharing: with k computing, each progresses at 1 / shared[k-1] samples per second (measured
  by `ako calibrate --processes`; beyond the table, shared[-1] x k / len(shared)). A straggler
  there computes at that speed and then waits (factor - 1) x its compute time, as the
  distributed runtime's straggler does, leaving the cores to the others meanwhile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import simpy


@dataclass(frozen=True)
class Costs:
    """Cost-model constants: `seconds_per_sample` (forward+backward, one worker, seconds),
    `bandwidth` (bytes/s of every up- and downlink; inf = free) and `latency` (seconds added to
    every message), `shared` (seconds per sample when 1, 2, ... workers compute at once on one
    shared machine; empty: every worker has a machine of its own), `gradient_ready` (per
    parameter tensor, in the model's order, the fraction of a step's compute time after which
    its gradient is final; empty: the default of the module docstring). Raises ValueError for
    negative values, fractions above 1 or a bandwidth <= 0."""

    seconds_per_sample: float
    bandwidth: float = math.inf
    latency: float = 0.0
    shared: tuple[float, ...] = ()
    gradient_ready: tuple[float, ...] = ()

    def __post_init__(self):
        if min((self.seconds_per_sample, self.latency, *self.shared, *self.gradient_ready)) < 0 or not self.bandwidth > 0:
            raise ValueError(f"bad costs {self}: times must be >= 0 and bandwidth > 0")
        if any(f > 1 for f in self.gradient_ready):
            raise ValueError(f"bad costs {self}: gradient_ready fractions must be at most 1")

    def bucket_ready(self, boundaries: list[int], buckets: list[tuple[int, int]]) -> list[float]:
        """The fraction of a step's compute time after which each bucket's gradient is final.
        `boundaries`: the replica's tensor offsets (`Replica.boundaries`); `buckets`: its
        [lo, hi) ranges (`Replica.buckets`). Raises ValueError when `gradient_ready` was
        measured for another number of tensors."""
        m = len(boundaries) - 1
        ready = self.gradient_ready or tuple(1 / 3 + 2 / 3 * (m - i) / m for i in range(m))
        if len(ready) != m:
            raise ValueError(f"gradient_ready has {len(ready)} fractions, the model {m} parameter tensors")
        return [max(f for f, b in zip(ready, boundaries) if lo <= b < hi) for lo, hi in buckets]

    def shared_seconds_per_sample(self, k: int) -> float:
        """Seconds per sample of each of `k` >= 1 computations running at once on the shared host."""
        if k <= len(self.shared):
            return self.shared[k - 1]
        return self.shared[-1] * k / len(self.shared)

    def compute_seconds(self, samples: int, factor: float = 1.0) -> float:
        """Seconds a worker slowed by `factor` takes for a gradient of `samples` samples."""
        return samples * self.seconds_per_sample * factor

    def transfer_seconds(self, nbytes: float) -> float:
        """Seconds `nbytes` occupy one link (0 when bandwidth is infinite)."""
        return 0.0 if math.isinf(self.bandwidth) else nbytes / self.bandwidth

    def ring_allreduce_seconds(self, nbytes: int, n: int) -> float:
        """Seconds of a ring all-reduce of `nbytes` over `n` nodes:
        2 (n-1)/n x nbytes / B + 2 (n-1) x latency (0 for n = 1)."""
        if n <= 1:
            return 0.0
        return self.transfer_seconds(ring_bytes(nbytes, n)) + 2 * (n - 1) * self.latency


def ring_bytes(nbytes: int, n: int) -> int:
    """Bytes each node sends (and receives) in a ring all-reduce of `nbytes` over n nodes,
    counted as the distributed runtime counts them: 2 (n-1) x nbytes // n."""
    return 2 * (n - 1) * nbytes // n


@dataclass
class Nic:
    """One node's NIC: when each direction is next free (virtual seconds), how long each has
    been busy (seconds) and the bytes it has carried."""

    up_free: float = 0.0
    down_free: float = 0.0
    up_busy: float = 0.0
    down_busy: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0


@dataclass
class Network:
    """The NICs of `nodes` nodes on one switch, costed by `costs` (see the module docstring)."""

    costs: Costs
    nodes: int
    nics: list[Nic] = field(init=False)

    def __post_init__(self):
        self.nics = [Nic() for _ in range(self.nodes)]

    def transmit(self, now: float, src: int, dst: int, nbytes: int) -> float:
        """Book a message of `nbytes` from `src` to `dst` sent at `now`; returns the virtual
        time it is delivered."""
        t = self.costs.transfer_seconds(nbytes)
        up, down = self.nics[src], self.nics[dst]
        up_start = max(now, up.up_free)
        up.up_free = up_start + t
        down.down_free = max(up_start, down.down_free) + t
        up.up_busy += t
        down.down_busy += t
        up.bytes_up += nbytes
        down.bytes_down += nbytes
        return down.down_free + self.costs.latency

    def all_reduce(self, now: float, members: list[int], nbytes: int) -> tuple[float, float]:
        """Book a ring all-reduce of `nbytes` over `members` (ranks) whose last member arrived
        at `now`; returns (start, end) in virtual seconds."""
        nics = [self.nics[r] for r in members]
        start = max([now] + [max(nic.up_free, nic.down_free) for nic in nics])
        n = len(members)
        seconds = self.costs.ring_allreduce_seconds(nbytes, n)
        busy, moved = self.costs.transfer_seconds(ring_bytes(nbytes, n)), ring_bytes(nbytes, n)
        for nic in nics:
            nic.up_free = nic.down_free = start + busy
            nic.up_busy += busy
            nic.down_busy += busy
            nic.bytes_up += moved
            nic.bytes_down += moved
        return start, start + seconds


class SharedHost:
    """Processor sharing of one machine's cores among the computations running at once (the
    shared host of the module docstring), in SimPy virtual time."""

    def __init__(self, env: simpy.Environment, costs: Costs):
        self.env, self.costs = env, costs
        self.remaining: dict[simpy.Event, float] = {}  # a computation's event -> samples left
        self.since = 0.0  # when `remaining` was last brought up to date
        self.timer = 0  # only the latest scheduled completion counts

    def compute(self, samples: int) -> simpy.Event:
        """An event that fires when `samples` samples have been computed on the shared cores."""
        self._advance()
        done = self.env.event()
        self.remaining[done] = float(samples)
        self._schedule()
        return done

    def _advance(self) -> None:
        if self.remaining:
            progress = (self.env.now - self.since) / self.costs.shared_seconds_per_sample(len(self.remaining))
            for event in self.remaining:
                self.remaining[event] -= progress
        self.since = self.env.now

    def _schedule(self) -> None:
        self.timer += 1
        if self.remaining:
            timer, first = self.timer, min(self.remaining.values())
            delay = max(first, 0.0) * self.costs.shared_seconds_per_sample(len(self.remaining))
            self.env.timeout(delay).callbacks.append(lambda _: self._finish(timer))

    def _finish(self, timer: int) -> None:
        if timer != self.timer:
            return
        self._advance()
        for event, left in list(self.remaining.items()):
            if left <= 1e-9:
                del self.remaining[event]
                event.succeed()
        self._schedule()
