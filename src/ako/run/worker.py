"""A worker's state, shared by the runtimes: its place in the data (`cursor.DataCursor`), when
it stops, its checkpoint calls and progress bar, and on rank 0 the evaluations
(`evaluation.Evaluator`)."""

from __future__ import annotations

import json
import math
import sys
import threading
from collections.abc import Callable
from typing import Protocol

import torch
from tqdm import tqdm

from ako.cluster import Slowdown, parse_straggler
from ako.config import TrainConfig
from ako.metrics import MetricsLog
from ako.replica import Replica
from ako.run.consensus import ReplicaExchange
from ako.run.cursor import DataCursor
from ako.run.evaluation import Evaluator

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
    """What `WorkerState` needs from a runtime to take checkpoints
    (`ako.runtime.distributed.checkpoint`)."""

    every: float  # seconds of training between checkpoints

    def announce(self, point: int) -> None:
        """Rank 0: tell every other rank to save at step `point`."""

    def save(self, point: int) -> None:
        """Save this rank's state as its part of the checkpoint at step `point`."""


class BarStream:
    """Where a progress bar writes: stderr, whose failures (a full disk, a read-only
    descriptor) drop the bar's text, not the run."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except (OSError, ValueError):
            return 0

    def flush(self) -> None:
        try:
            self.stream.flush()
        except (OSError, ValueError):
            pass

    def __getattr__(self, name):  # isatty, fileno, encoding: stderr's own
        return getattr(self.stream, name)


class WorkerState:
    """A worker's run: where it is in its shard (`cursor`), whether it should stop, and what
    happens between two steps (`before_step`).

    Every `eval_every` epochs of rank 0's progress, rank 0 takes a snapshot of its replica
    before the next step (`evaluator`, given a `log`). With a target accuracy the snapshot is
    evaluated at once on `test_set` (clock paused), and reaching the target calls `on_target`
    (which tells the other workers) and makes `should_stop` true. Without one, snapshots are
    evaluated after training, so evaluation never slows training down.

    With `consensus` (strategies whose replicas differ), every worker hands rank 0 a copy of its
    replica at the same steps, and rank 0's records also hold the consensus distance of the
    replicas and the test loss and accuracy of their average (see `ako.run.consensus`).

    With a `checkpointer`, rank 0 calls for a checkpoint every `checkpointer.every` seconds of
    training, at a step a little ahead, and each worker saves when it gets there (the runtime
    sets `checkpoint_at` when rank 0's call arrives); rank 0 first logs its evaluations.
    `traffic()` gives the (sent, received) bytes so far, for the records.
    """

    def __init__(
        self, *, config: TrainConfig, rank: int, world_size: int, replica: Replica, train_set, test_set,
        clock: Clock, traffic: Callable[[], tuple[int, int]], on_target: Callable[[], None],
        log: MetricsLog | None = None, consensus: ReplicaExchange | None = None, checkpointer: Checkpointer | None = None,
        num_workers: int = 0, progress_bar: bool = False,
    ):  # fmt: skip
        self.config, self.rank, self.world_size, self.replica = config, rank, world_size, replica
        self.clock, self.traffic, self.on_target = clock, traffic, on_target
        self.consensus, self.checkpointer = consensus, checkpointer
        self.cursor = DataCursor(train_set, rank, world_size, config.batch_size, config.seed, accumulate=config.accumulate,
                                 collate_fn=replica.collate_fn, num_workers=num_workers, timeout=config.timeout)  # fmt: skip
        self.goal = config.goal
        self.evaluator = None
        if log is not None:
            self.evaluator = Evaluator(replica, test_set, log, world_size, consensus, eager=self.goal is not None)
        per_epoch = self.cursor.steps_per_epoch
        self.planned_steps = max(1, round(config.epochs * per_epoch))
        self.eval_steps = max(1, round(config.eval_every * per_epoch))
        self.slowdown = Slowdown([parse_straggler(t) for t in config.straggler], rank, config.seed)
        self.stop_requested = False
        self.loss_sum, self.loss_count = 0.0, 0  # training losses since the last record
        self.checkpoint_at: int | None = None  # the step of the checkpoint called for, if any
        self.next_checkpoint = checkpointer.every if checkpointer is not None else math.inf
        self.resumed = (0, 0.0)  # (step, training seconds) this process started from
        self.resumed_wall = 0.0
        self.bar = None
        self.evaluation_bar = rank == 0 and progress_bar  # after training: a bar over the evaluations left
        if self.evaluation_bar:  # the simulator draws its own (`ako.runtime.simulated.progress`)
            tqdm.set_lock(threading.RLock())  # not tqdm's default multiprocessing lock: a killed worker would leak it
            self.bar = tqdm(total=self.planned_steps, unit="step", file=BarStream(sys.stderr))

    def before_step(self) -> None:
        """Between two steps: take a checkpoint if one is due; at an evaluation point, rank 0's
        snapshot (or this worker's copy for the consensus distance); log what is ready."""
        if self.checkpointer is not None:
            self._checkpoint()
        step = self.cursor.step
        if step % self.eval_steps == 0:
            if self.evaluator is not None:
                self._snapshot(step // self.eval_steps)
            elif self.consensus is not None:
                with self.clock.pause():  # a measurement, not training
                    self.consensus.report_replica(step // self.eval_steps, self.replica.params)
        if self.evaluator is not None and self.evaluator.evaluated_first:  # awaiting the others' replicas
            with self.clock.pause():
                self.evaluator.log_ready(final=False)

    def _snapshot(self, point: int) -> None:
        if not self.evaluator.keep(self._progress_record(), point):
            return
        with self.clock.pause():
            metrics = self._evaluate()
        if self.goal is not None and self.goal.met(metrics) and not self.stop_requested:
            self.stop_requested = True
            self.on_target()

    def _evaluate(self, final: bool = False) -> dict:
        # after training, each record is logged as soon as it is known: Ctrl-C then keeps them
        metrics = self.evaluator.evaluate(final, each=final)
        if self.bar is not None and metrics:
            name = shown_metric(metrics, self.goal)
            label = "val_loss" if name == "loss" and "perplexity" in metrics else name[:8]
            self.bar.set_postfix({label: f"{metrics[name]:.4f}", "epoch": f"{self.cursor.epoch:.2f}"})
        return metrics

    def _checkpoint(self) -> None:
        now, step = self.clock.now(), self.cursor.step
        if self.rank == 0 and self.checkpoint_at is None and now >= self.next_checkpoint:
            step_seconds = (now - self.resumed[1]) / max(1, step - self.resumed[0])
            self.checkpoint_at = step + max(2, math.ceil(_CALL_AHEAD / max(step_seconds, 1e-6)))
            self.next_checkpoint = now + self.checkpointer.every
            self.checkpointer.announce(self.checkpoint_at)
        if self.checkpoint_at is not None and step >= self.checkpoint_at:
            point, self.checkpoint_at = self.checkpoint_at, None
            with self.clock.pause():
                if self.evaluator is not None:  # what is evaluated by now is in metrics.jsonl
                    self._evaluate()
                self.checkpointer.save(point)

    def state_dict(self) -> dict:
        """This worker's place in the run, for a checkpoint: the cursor's (step, samples,
        A-BSP's waiting samples), straggler draws, torch's RNG, training and wall seconds."""
        return {
            **self.cursor.state_dict(),
            "slowdown_rng": json.dumps(self.slowdown.rng.bit_generator.state),
            "torch_rng": torch.get_rng_state(),
            "seconds": self.clock.now(),
            "wall": self.clock.wall(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a checkpoint's `state_dict`; the runtime starts the clock from
        `resumed[1]` seconds."""
        self.cursor.load_state_dict(state)
        self.slowdown.rng.bit_generator.state = json.loads(state["slowdown_rng"])
        torch.set_rng_state(state["torch_rng"])
        self.resumed = (self.cursor.step, float(state["seconds"]))
        self.resumed_wall = float(state["wall"])
        self.next_checkpoint = self.resumed[1] + (self.checkpointer.every if self.checkpointer else math.inf)
        if self.bar is not None:
            self.bar.update(self.cursor.step)

    def computed(self, loss: float) -> None:
        """Called after each gradient: tallies the training loss for the next record and moves
        the progress bar (rank 0)."""
        self.loss_sum, self.loss_count = self.loss_sum + loss, self.loss_count + 1
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", epoch=f"{self.cursor.epoch:.2f}", refresh=False)
            self.bar.update()

    def should_stop(self) -> bool:
        """Epochs done, time budget spent, or the target reached (here or on rank 0)."""
        limit = self.config.max_time
        return self.stop_requested or self.plan_done() or (limit is not None and self.clock.now() >= limit)

    def plan_done(self) -> bool:
        """The planned steps (--epochs) are done: every worker gets there at the same step."""
        return self.cursor.step >= self.planned_steps

    def _progress_record(self) -> dict:
        sent, received = self.traffic()
        training = {}
        if self.loss_count:  # the mean mini-batch loss since the last record, and the rate now
            training["train_loss"] = round(self.loss_sum / self.loss_count, 5)
            self.loss_sum, self.loss_count = 0.0, 0
        if self.replica.optimizer.steps:  # this worker steps its optimizer (not bsp's, whose servers do)
            training["lr"] = float(f"{self.replica.optimizer.lr:.6g}")
        return {
            "time": round(self.clock.now(), 4),
            "wall": round(self.clock.wall(), 4),
            "epoch": round(self.cursor.epoch, 4),
            "samples": self.cursor.step * self.cursor.batch_size * self.world_size,
            "bytes_sent": sent,
            "bytes_received": received,
            **training,
        }

    def keep_metrics(self) -> None:
        """Rank 0, when training failed: evaluate and log the snapshots taken so far, so that
        metrics.jsonl holds the run up to the failure. Never raises: the failure is the news."""
        try:
            with self.clock.pause():
                self.evaluator.evaluate(final=True, each=True)
        except Exception:  # a peer's copy that cannot come, a broken evaluation: keep what is logged
            pass

    def evaluations_ahead(self, extra: int) -> None:
        """Rank 0, after training: the training bar ends; with `evaluation_bar`, a bar counts
        the evaluations of the test set left (the snapshots kept, the final replica's in `finish`,
        and `extra` more), until `close_bar`: without it, minutes could pass in silence."""
        self.close_bar()
        if self.evaluation_bar:
            self.bar = tqdm(total=self.evaluator.pending() + 1 + extra, desc="evaluating", unit="evaluation", leave=False,
                            file=BarStream(sys.stderr))  # fmt: skip
            self.evaluator.tick = self.bar.update

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.refresh()  # its last count (tqdm draws at most every 0.1 s), where it is left
            self.bar.close()
            self.bar = None
        if self.evaluator is not None:
            self.evaluator.tick = lambda: None

    def finish(self, final_fields: dict | None = None) -> dict:
        """Rank 0, after training (clock stopped): evaluate and log the remaining snapshots and
        the final replica, whose record gets `final_fields` as well; returns the final record."""
        self.evaluator.keep(self._progress_record(), None, extra=final_fields)
        self._evaluate(final=True)
        return self.evaluator.log.records[-1]


def shown_metric(metrics: dict, goal=None) -> str:
    """The evaluated metric a progress bar shows: the target's, else a language model's loss,
    else accuracy, else the first one."""
    if goal is not None and goal.metric in metrics:
        return goal.metric
    if "perplexity" in metrics:
        return "loss"
    return "accuracy" if "accuracy" in metrics else next(iter(metrics))
