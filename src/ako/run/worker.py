"""A worker's training state, shared by the runtimes: its data shard, when to stop, and (on
rank 0) the evaluations that make the metrics log and the progress bar."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from tqdm import tqdm

from ako.cluster import Slowdown, parse_straggler
from ako.config import TrainConfig
from ako.data import ShardSampler, fetch
from ako.metrics import MetricsLog
from ako.replica import Replica
from ako.run.consensus import ReplicaExchange, consensus_distance

_SNAPSHOT_BYTES = 256 << 20
_CALL_AHEAD = 0.2  # seconds of steps between calling for a checkpoint and taking it: the call must arrive first


class Clock(Protocol):
    """Training seconds as a runtime counts them: `runtime.distributed.runtime.WallClock` (wall
    time less evaluation pauses) or `runtime.simulated.runtime.SimClock` (virtual time)."""

    def now(self) -> float:
        """Seconds of training so far."""

    def wall(self) -> float:
        """Seconds since training began, pauses included."""

    def pause(self):
        """A context manager: time inside it is not training (evaluations, checkpoints)."""


class Checkpointer(Protocol):
    """What `WorkerState` needs from a runtime to take checkpoints (`ako.runtime.distributed.checkpoint`)."""

    every: float  # seconds of training between checkpoints

    def announce(self, point: int) -> None:
        """Rank 0: tell every other rank to save at step `point`."""

    def save(self, point: int) -> None:
        """Save this rank's state as its part of the checkpoint at step `point`."""


@dataclass
class _Snapshot:
    """Rank 0's replica (numel,) at evaluation point `point` (None: the end of training) and
    its record, until it is logged; `accuracy` once evaluated; `extra` fields for the record
    known beforehand (the end's consensus)."""

    record: dict
    params: torch.Tensor
    point: int | None
    accuracy: float | None = None
    extra: dict = field(default_factory=dict)


class WorkerState:
    """Where a worker is in its shard, and whether it should stop.

    Every `eval_every` epochs of rank 0's progress, rank 0 takes a snapshot of its replica
    before the next mini-batch. With a target accuracy the snapshot is evaluated at once on the
    test set (clock paused), and reaching the target calls `on_target` (which tells the other
    workers) and makes `should_stop` true. Without one, snapshots are evaluated after training,
    so evaluation never slows training down.

    With `consensus` (strategies whose replicas differ), every worker hands rank 0 a copy of its
    replica at the same steps, and rank 0's records also hold the consensus distance of the
    replicas and the test loss and accuracy of their average (see `ako.run.consensus`).

    With a `checkpointer`, rank 0 calls for a checkpoint every `checkpointer.every` seconds of
    training, at a step a little ahead, and each worker saves when it gets there (the runtime
    sets `checkpoint_at` when rank 0's call arrives); rank 0 first logs its evaluations.
    """

    def __init__(
        self,
        config: TrainConfig,
        rank: int,
        world_size: int,
        train_set,
        test_set,
        replica: Replica,
        clock: Clock,
        log: MetricsLog | None,
        traffic: Callable[[], tuple[int, int]],
        on_target: Callable[[], None],
        consensus: ReplicaExchange | None = None,
        checkpointer: Checkpointer | None = None,
    ):
        self.config, self.rank, self.world_size = config, rank, world_size
        self.checkpointer = checkpointer
        self.checkpoint_at: int | None = None  # the step of the checkpoint called for, if any
        self.next_checkpoint = checkpointer.every if checkpointer is not None else math.inf
        self.resumed = (0, 0.0)  # (step, training seconds) this process started from
        self.resumed_wall = 0.0
        self.consensus = consensus
        self.train_set, self.test_set, self.replica = train_set, test_set, replica
        self.clock, self.log, self.traffic, self.on_target = clock, log, traffic, on_target
        self.sampler = ShardSampler(len(train_set), rank, world_size, config.batch_size, config.seed)
        per_epoch = self.sampler.steps_per_epoch
        self.planned_steps = max(1, round(config.epochs * per_epoch))
        self.eval_steps = max(1, round(config.eval_every * per_epoch))
        self.slowdown = Slowdown([parse_straggler(t) for t in config.straggler], rank, config.seed)
        self.step = 0
        self.samples = 0
        self.stop_requested = False
        # A-BSP: samples assigned but not processed (first in line next time), with the
        # iteration each was first assigned in, and how far the sample stream has been taken
        self.waiting = torch.empty(0, dtype=torch.int64)
        self.waiting_since = torch.empty(0, dtype=torch.int64)
        self.taken = 0
        self.snapshots: list[_Snapshot] = []  # awaiting evaluation or logging, oldest first
        self.bar = None
        if rank == 0:
            tqdm.set_lock(threading.RLock())  # not tqdm's default multiprocessing lock: a killed worker would leak it
            self.bar = tqdm(total=self.planned_steps, unit="step", disable=None if config.progress is None else not config.progress)

    @property
    def epoch(self) -> float:
        return self.step / self.sampler.steps_per_epoch

    def next_batch(self):
        """The next mini-batch (x (B, C, H, W), y (B,)); takes an evaluation snapshot first
        when one is due."""
        self._before_step()
        x, y = fetch(self.train_set, self.sampler.batch(self.step))
        self.step += 1
        self.samples += len(y)
        return x, y

    def next_assignment(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A-BSP: this iteration's samples (indices int64 (B,)): those left waiting last time
        first, then fresh ones up to a mini-batch; and the iteration each was first assigned in."""
        self._before_step()
        fresh = self.sampler.stream(self.taken, self.config.batch_size - len(self.waiting))
        self.taken += len(fresh)
        indices = torch.cat([self.waiting, fresh])
        since = torch.cat([self.waiting_since, torch.full_like(fresh, self.step)])
        self.step += 1
        return indices, since

    def processed(self, indices: torch.Tensor, since: torch.Tensor, count: int) -> int:
        """A-BSP: the first `count` of the assignment were processed; the rest wait for next
        time. Returns the age in iterations of the oldest sample now waiting (0 if none)."""
        self.samples += count
        self.waiting, self.waiting_since = indices[count:], since[count:]
        return 0 if len(self.waiting) == 0 else int(self.step - self.waiting_since.min())

    def _before_step(self) -> None:
        if self.checkpointer is not None:
            self._checkpoint()
        if self.step % self.eval_steps == 0:
            if self.log is not None:
                self.snapshot()
            elif self.consensus is not None:
                with self.clock.pause():  # a measurement, not training
                    self.consensus.report_replica(self.step // self.eval_steps, self.replica.params)
        if self.snapshots and self.snapshots[0].accuracy is not None:  # evaluated, awaiting the others' replicas
            with self.clock.pause():
                self._log_ready(final=False)

    def _checkpoint(self) -> None:
        now = self.clock.now()
        if self.rank == 0 and self.checkpoint_at is None and now >= self.next_checkpoint:
            step_seconds = (now - self.resumed[1]) / max(1, self.step - self.resumed[0])
            self.checkpoint_at = self.step + max(2, math.ceil(_CALL_AHEAD / max(step_seconds, 1e-6)))
            self.next_checkpoint = now + self.checkpointer.every
            self.checkpointer.announce(self.checkpoint_at)
        if self.checkpoint_at is not None and self.step >= self.checkpoint_at:
            point, self.checkpoint_at = self.checkpoint_at, None
            with self.clock.pause():
                if self.log is not None:  # what is evaluated by now is in metrics.jsonl
                    self.evaluate_snapshots()
                self.checkpointer.save(point)

    def state_dict(self) -> dict:
        """This worker's place in the run, for a checkpoint: step, samples, A-BSP's waiting
        samples, straggler draws, torch's RNG, training and wall seconds."""
        return {
            "step": self.step,
            "samples": self.samples,
            "taken": self.taken,
            "waiting": self.waiting.clone(),
            "waiting_since": self.waiting_since.clone(),
            "slowdown_rng": json.dumps(self.slowdown.rng.bit_generator.state),
            "torch_rng": torch.get_rng_state(),
            "seconds": self.clock.now(),
            "wall": self.clock.wall(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a checkpoint's `state_dict`; the runtime starts the clock from
        `resumed[1]` seconds."""
        self.step, self.samples, self.taken = int(state["step"]), int(state["samples"]), int(state["taken"])
        self.waiting, self.waiting_since = state["waiting"], state["waiting_since"]
        self.slowdown.rng.bit_generator.state = json.loads(state["slowdown_rng"])
        torch.set_rng_state(state["torch_rng"])
        self.resumed = (self.step, float(state["seconds"]))
        self.resumed_wall = float(state["wall"])
        self.next_checkpoint = self.resumed[1] + (self.checkpointer.every if self.checkpointer else math.inf)
        if self.bar is not None:
            self.bar.update(self.step)

    def computed(self, loss: float) -> None:
        """Called after each gradient: moves the progress bar (rank 0)."""
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", epoch=f"{self.epoch:.2f}", refresh=False)
            self.bar.update()

    def should_stop(self) -> bool:
        """Epochs done, time budget spent, or the target reached (here or on rank 0)."""
        limit = self.config.max_time
        return (
            self.stop_requested
            or self.step >= self.planned_steps
            or (limit is not None and self.clock.now() >= limit)
        )

    def _progress_record(self) -> dict:
        sent, received = self.traffic()
        return {
            "time": round(self.clock.now(), 4),
            "wall": round(self.clock.wall(), 4),
            "epoch": round(self.epoch, 4),
            "samples": self.step * self.config.batch_size * self.world_size,
            "bytes_sent": sent,
            "bytes_received": received,
        }

    def snapshot(self) -> None:
        """Record rank 0's replica and progress now, for evaluation now (with a target, or when
        the snapshots waiting, and the peers' replicas for them, would take more than 256 MB)
        or after training."""
        point = self.step // self.eval_steps
        self.snapshots.append(_Snapshot(self._progress_record(), self.replica.params.clone(), point))
        target = self.config.target_accuracy
        copies = self.world_size if self.consensus is not None else 1
        if target is None and len(self.snapshots) * copies * self.replica.grad_bytes <= _SNAPSHOT_BYTES:
            return
        with self.clock.pause():
            accuracy = self.evaluate_snapshots()
        if target is not None and accuracy >= target and not self.stop_requested:
            self.stop_requested = True
            self.on_target()

    def evaluate_snapshots(self, final: bool = False) -> float:
        """Evaluate the snapshots not yet evaluated and log, oldest first, those whose
        consensus is known (all of them when `final`); returns the last accuracy."""
        accuracy = 0.0
        for s in self.snapshots:
            if s.accuracy is None:
                loss, s.accuracy = self.replica.evaluate_params(s.params, self.test_set)
                s.record.update(test_loss=round(loss, 5), test_accuracy=round(s.accuracy, 5))
            accuracy = s.accuracy
        self._log_ready(final)
        if self.bar is not None:
            self.bar.set_postfix(acc=f"{accuracy:.4f}", epoch=f"{self.epoch:.2f}")
        return accuracy

    def _log_ready(self, final: bool) -> None:
        """Log the evaluated snapshots at the head of the line whose point every live worker
        has reported (when `final`, with whatever was reported)."""
        while self.snapshots and self.snapshots[0].accuracy is not None:
            s = self.snapshots[0]
            if self.consensus is not None and s.point is not None:
                others = self.consensus.peer_replicas(s.point, final)
                if others is None:
                    return
                s.record.update(self.consensus_record([s.params, *others]))
            self.log.append({**s.record, **s.extra})
            self.snapshots.pop(0)

    def consensus_record(self, replicas: list[torch.Tensor], weights: list[float] | None = None) -> dict:
        """How many replicas, their consensus distance, and the test loss and accuracy of their
        (weighted) average: the fields the records add where replicas differ."""
        stacked = torch.stack([r.to(self.replica.params.device) for r in replicas])
        distance, average = consensus_distance(stacked, weights)
        loss, accuracy = self.replica.evaluate_params(average, self.test_set)
        return {
            "replicas": len(replicas),
            "consensus_distance": float(f"{distance:.4g}"),
            "average_loss": round(loss, 5),
            "average_accuracy": round(accuracy, 5),
        }

    def finish(self, final_fields: dict | None = None) -> dict:
        """After training (clock stopped): evaluate and log the remaining snapshots and the
        final replica, whose record gets `final_fields` as well; returns the final record."""
        if self.bar is not None:
            self.bar.close()
        self.snapshots.append(_Snapshot(self._progress_record(), self.replica.params.clone(), None, extra=final_fields or {}))
        self.evaluate_snapshots(final=True)
        return self.log.records[-1]
