"""A worker's training state, shared by the runtimes: its data shard, when to stop, and (on
rank 0) the evaluations that make the metrics log and the progress bar."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager

from tqdm import tqdm

from ako.config import TrainConfig
from ako.data import ShardSampler, fetch
from ako.metrics import MetricsLog
from ako.replica import Replica


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

    Every `eval_every` epochs of rank 0's progress, rank 0 evaluates its replica on the test set
    before the next mini-batch and appends a record to the metrics log; reaching the target
    accuracy calls `on_target` (which tells the other workers) and makes `should_stop` true.
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
        self.step = 0
        self.samples = 0
        self.stop_requested = False
        self.last_eval_step: int | None = None
        self.bar = None
        if rank == 0:
            self.bar = tqdm(total=self.planned_steps, unit="step", disable=None if config.progress else True)

    @property
    def epoch(self) -> float:
        return self.step / self.sampler.steps_per_epoch

    def next_batch(self):
        """The next mini-batch (x (B, C, H, W), y (B,)); evaluates first when one is due."""
        if self.log is not None and self.step % self.eval_steps == 0:
            self.evaluate()
        x, y = fetch(self.train_set, self.sampler.batch(self.step))
        self.step += 1
        self.samples += len(y)
        if self.bar is not None:
            self.bar.update()
        return x, y

    def should_stop(self) -> bool:
        limit = self.config.max_time
        return (
            self.stop_requested
            or self.step >= self.planned_steps
            or (limit is not None and self.clock.now() >= limit)
        )

    def evaluate(self, final: bool = False) -> dict:
        """Evaluate rank 0's replica now (clock paused) and log it; returns the record. The
        final evaluation, after training, does not look at the target."""
        with self.clock.pause():
            loss, accuracy = self.replica.evaluate(self.test_set)
        sent, received = self.traffic()
        record = {
            "time": round(self.clock.now(), 4),
            "wall": round(self.clock.wall(), 4),
            "epoch": round(self.epoch, 4),
            "samples": self.step * self.config.batch_size * self.world_size,
            "test_loss": round(loss, 5),
            "test_accuracy": round(accuracy, 5),
            "bytes_sent": sent,
            "bytes_received": received,
        }
        self.log.append(record)
        self.last_eval_step = self.step
        if self.bar is not None:
            self.bar.set_postfix(acc=f"{accuracy:.4f}", epoch=f"{self.epoch:.2f}", refresh=False)
        target = self.config.target_accuracy
        if not final and target is not None and accuracy >= target and not self.stop_requested:
            self.stop_requested = True
            self.on_target()
        return record

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
