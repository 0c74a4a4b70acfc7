"""A worker's place in its data: its shard (`ShardSampler`), the steps and samples done, and
the samples waiting from a partial step (A-BSP's, or Ako's behind a straggler)."""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
from itertools import count

import torch
from torch.utils.data import DataLoader, default_collate

from ako.data import ShardSampler, fetch


class DataCursor:
    """Where worker `rank` of `world_size` is in its shard of `train_set`: one optimizer step
    takes `accumulate` micro-batches of `batch_size` samples (reshuffled every epoch from
    `seed`), each made by `collate_fn` (default: `fetch`'s). With `num_workers` > 0 a torch
    `DataLoader` with that many processes loads them ahead, in the same order, and a batch
    that takes longer than `timeout` seconds fails the run.

    A partial step (A-BSP's iterations; Ako's when a worker is behind) may end before all of a
    mini-batch is processed: the samples not done wait (`waiting`, with the step each was
    first assigned in) and go first next time, then fresh ones from the shard's sample stream,
    of which `taken` have been handed out. A whole step takes the waiting samples and fresh
    ones, or, when none wait, the next whole batch of that stream (`ShardSampler.batch(step)`
    while no step was partial), loaded ahead with `num_workers`: a loader made again from
    where the stream got to after partial steps. `cut` counts the partial steps that left
    samples waiting."""

    def __init__(self, train_set, rank: int, world_size: int, batch_size: int, seed: int, *, accumulate: int = 1,
                 collate_fn=None, num_workers: int = 0, timeout: float = 0.0):  # fmt: skip
        self.train_set, self.micro, self.batch_size = train_set, batch_size, batch_size * accumulate
        self.collate_fn, self.num_workers, self.timeout = collate_fn, num_workers, timeout
        self.sampler = ShardSampler(len(train_set), rank, world_size, self.batch_size, seed)
        self._loaded = None  # (stream position it reads next, the DataLoader's iterator)
        self.step = 0  # mini-batches (or A-BSP assignments) begun
        self.samples = 0  # samples processed
        self.waiting = torch.empty(0, dtype=torch.int64)
        self.waiting_since = torch.empty(0, dtype=torch.int64)
        self.taken = 0
        self.cut = 0

    @property
    def steps_per_epoch(self) -> int:
        return self.sampler.steps_per_epoch

    @property
    def epoch(self) -> float:
        return self.step / self.sampler.steps_per_epoch

    def next_batch(self) -> list:
        """The next step's micro-batches (`accumulate` of them, each of `batch_size` samples:
        (x (B, C, H, W), y (B,)) for the built-in data sets): the samples waiting from a partial
        step first, then fresh ones."""
        if len(self.waiting):  # fetched here: the loader reads ahead in whole batches of the stream
            indices, _ = self.next_assignment()
            self.waiting, self.waiting_since = indices[:0], indices[:0]
            self.samples += self.batch_size
            return [fetch(self.train_set, chunk, self.collate_fn) for chunk in indices.split(self.micro)]
        chunks = self.sampler.stream(self.taken, self.batch_size).split(self.micro)
        if self.num_workers:
            if self._loaded is None or self._loaded[0] != self.taken:  # a partial step moved the stream on
                self._loaded = (self.taken, iter(self._loader()))
            batches = [next(self._loaded[1]) for _ in chunks]
            self._loaded = (self.taken + self.batch_size, self._loaded[1])
        else:
            batches = [fetch(self.train_set, chunk, self.collate_fn) for chunk in chunks]
        self.step += 1
        self.taken += self.batch_size
        self.samples += self.batch_size
        return batches

    def _loader(self) -> DataLoader:
        """A DataLoader of whole steps' micro-batches from the stream position `taken` on,
        forever (the run stops it)."""
        start, size = self.taken, self.batch_size
        micro_batches = ([c.tolist() for c in self.sampler.stream(start + k * size, size).split(self.micro)] for k in count())
        order = _Chunks(micro_batches)
        return DataLoader(self.train_set, batch_sampler=order, collate_fn=self.collate_fn or default_collate,
                          num_workers=self.num_workers, timeout=self.timeout, worker_init_fn=functools.partial(_die_with_parent, os.getpid()))  # fmt: skip

    def next_assignment(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A partial step's samples (indices int64 (B,)): those left waiting last time first,
        then fresh ones up to a mini-batch; and the step each was first assigned in."""
        fresh = self.sampler.stream(self.taken, self.batch_size - len(self.waiting))
        self.taken += len(fresh)
        indices = torch.cat([self.waiting, fresh])
        since = torch.cat([self.waiting_since, torch.full_like(fresh, self.step)])
        self.step += 1
        return indices, since

    def processed(self, indices: torch.Tensor, since: torch.Tensor, count: int) -> int:
        """The first `count` of a partial step's assignment were processed; the rest wait for
        next time. Returns the age in steps of the oldest sample now waiting (0 if none)."""
        self.samples += count
        self.cut += count < len(indices)
        self.waiting, self.waiting_since = indices[count:], since[count:]
        return 0 if len(self.waiting) == 0 else int(self.step - self.waiting_since.min())

    def state_dict(self) -> dict:
        """For a checkpoint: steps, samples, the waiting samples and how far the stream went."""
        return {
            "step": self.step,
            "samples": self.samples,
            "taken": self.taken,
            "cut": self.cut,
            "waiting": self.waiting.clone(),
            "waiting_since": self.waiting_since.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        self._loaded = None
        self.step, self.samples, self.taken = int(state["step"]), int(state["samples"]), int(state["taken"])
        self.waiting, self.waiting_since = state["waiting"], state["waiting_since"]
        cut = state.get("cut", 0)  # a count for the summary; checkpoints before it have none
        self.cut = cut if isinstance(cut, int) and not isinstance(cut, bool) and cut >= 0 else 0
        if self.taken == 0 and not len(self.waiting):  # saved before whole steps counted `taken`
            self.taken = self.step * self.batch_size


def _die_with_parent(parent: int, _worker_id: int) -> None:
    """A loader process ends when its worker (pid `parent`) does (Linux): a failed worker
    leaves the run at once, and a loader stuck in the user's __getitem__ must not outlive it;
    nor one whose worker died while it was starting (loading torch), before this ran."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)


class _Chunks:
    """A batch sampler over an endless stream of steps' micro-batches (lists of indices)."""

    def __init__(self, steps):
        self.steps = steps

    def __iter__(self):
        for step in self.steps:
            yield from step
