"""A worker's training state, shared by the runtimes: its data shard, when to stop, and (on
rank 0) the evaluations that make the metrics log and the progress bar."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch
from tqdm import tqdm

from ako.cluster import Slowdown, parse_straggler
from ako.config import TrainConfig
from ako.data import ShardSampler, fetch
from ako.metrics import MetricsLog
from ako.replica import Replica


_SNAPSHOT_BYTES = 256 << 20


class Clock:
    """Training seconds: wall time since `begin`, less the time spent in `paused` blocks
    (evaluations), so time-to-accuracy counts training only."""

    def __init__(self):
        self.start = time.perf_counter()
        self.paused = 0.0
        self.stopped: float | None = None

    def begin(self) -> None:
        self.start, self.paused, self.stopped = time.perf_counter(), 0.0, None

    def stop(self) -> None:
        """Freeze the clock at the end of training (later evaluations do not move it)."""
        self.stopped = time.perf_counter()

    def wall(self) -> float:
        return (self.stopped or time.perf_counter()) - self.start

    def now(self) -> float:
        return self.wall() - self.paused

    @contextmanager
    def pause(self):
        t = time.perf_counter()
        try:
            yield
        finally:
            if self.stopped is None:
                self.paused += time.perf_counter() - t


class WorkerState:
    """Where a worker is in its shard, and whether it should stop.

    Every `eval_every` epochs of rank 0's progress, rank 0 takes a snapshot of its replica
    before the next mini-batch. With a target accuracy the snapshot is evaluated at once on the
    test set (clock paused), and reaching the target calls `on_target` (which tells the other
    workers) and makes `should_stop` true. Without one, snapshots are evaluated after training,
    so evaluation never slows training down.
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
    ):
        self.config, self.rank, self.world_size = config, rank, world_size
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
        self.snapshots: list[tuple[dict, torch.Tensor]] = []  # awaiting evaluation
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
        if self.log is not None and self.step % self.eval_steps == 0:
            self.snapshot()

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
        the snapshots waiting would take more than 256 MB) or after training."""
        self.snapshots.append((self._progress_record(), self.replica.params.clone()))
        target = self.config.target_accuracy
        if target is None and len(self.snapshots) * self.replica.grad_bytes <= _SNAPSHOT_BYTES:
            return
        with self.clock.pause():
            accuracy = self.evaluate_snapshots()
        if target is not None and accuracy >= target and not self.stop_requested:
            self.stop_requested = True
            self.on_target()

    def evaluate_snapshots(self) -> float:
        """Evaluate and log the snapshots not yet evaluated; returns the last accuracy."""
        accuracy = 0.0
        for record, params in self.snapshots:
            loss, accuracy = self.replica.evaluate_params(params, self.test_set)
            self.log.append({**record, "test_loss": round(loss, 5), "test_accuracy": round(accuracy, 5)})
        self.snapshots = []
        if self.bar is not None:
            self.bar.set_postfix(acc=f"{accuracy:.4f}", epoch=f"{self.epoch:.2f}")
        return accuracy

    def finish(self) -> dict:
        """After training (clock stopped): evaluate the remaining snapshots and the final
        replica; returns the final record."""
        if self.bar is not None:
            self.bar.close()
        self.snapshots.append((self._progress_record(), self.replica.params.clone()))
        self.evaluate_snapshots()
        return self.log.records[-1]
