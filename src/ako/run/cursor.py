"""A worker's place in its data: its shard (`ShardSampler`), the steps and samples done, and
A-BSP's samples waiting from an unfinished iteration."""

from __future__ import annotations

import torch

from ako.data import ShardSampler, fetch


class DataCursor:
    """Where worker `rank` of `world_size` is in its shard of `train_set` (mini-batches of
    `batch_size` samples, reshuffled every epoch from `seed`).

    A-BSP's iterations may end before all of a mini-batch is processed: the samples not done
    wait (`waiting`, with the iteration each was first assigned in) and go first next time,
    then fresh ones from the shard's sample stream, of which `taken` have been handed out."""

    def __init__(self, train_set, rank: int, world_size: int, batch_size: int, seed: int):
        self.train_set, self.batch_size = train_set, batch_size
        self.sampler = ShardSampler(len(train_set), rank, world_size, batch_size, seed)
        self.step = 0  # mini-batches (or A-BSP assignments) begun
        self.samples = 0  # samples processed
        self.waiting = torch.empty(0, dtype=torch.int64)
        self.waiting_since = torch.empty(0, dtype=torch.int64)
        self.taken = 0

    @property
    def steps_per_epoch(self) -> int:
        return self.sampler.steps_per_epoch

    @property
    def epoch(self) -> float:
        return self.step / self.sampler.steps_per_epoch

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next mini-batch: x (B, C, H, W), y (B,)."""
        x, y = fetch(self.train_set, self.sampler.batch(self.step))
        self.step += 1
        self.samples += len(y)
        return x, y

    def next_assignment(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A-BSP: this iteration's samples (indices int64 (B,)): those left waiting last time
        first, then fresh ones up to a mini-batch; and the iteration each was first assigned in."""
        fresh = self.sampler.stream(self.taken, self.batch_size - len(self.waiting))
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

    def state_dict(self) -> dict:
        """For a checkpoint: steps, samples, A-BSP's waiting samples and how far the stream went."""
        return {
            "step": self.step,
            "samples": self.samples,
            "taken": self.taken,
            "waiting": self.waiting.clone(),
            "waiting_since": self.waiting_since.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.step, self.samples, self.taken = int(state["step"]), int(state["samples"]), int(state["taken"])
        self.waiting, self.waiting_since = state["waiting"], state["waiting_since"]
