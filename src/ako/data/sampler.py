"""Per-worker sharding of a data set into mini-batches, and batch fetching."""

from __future__ import annotations


import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from ako.data.text import TokenWindows

# Multiplier that spreads (seed, epoch) pairs apart before seeding torch's generator.
_EPOCH_STRIDE = 1_000_003
_SEED_MODULUS = 2**64  # torch.Generator.manual_seed accepts values in [0, 2**64)


class ShardSampler:
    """Disjoint, equal-sized, per-epoch reshuffled shards of ``range(dataset_size)``.

    For epoch ``e`` all workers draw the same permutation
    ``torch.randperm(dataset_size, generator=Generator().manual_seed((seed * 1_000_003 + e)
    mod 2**64))``; worker ``rank`` takes ``perm[rank::world_size][:dataset_size // world_size]``.
    Shards are equal in size so every worker runs the same number of steps; the
    ``dataset_size % world_size`` leftover samples of an epoch are skipped that epoch (which ones
    changes from epoch to epoch). Batches are consecutive chunks of ``batch_size`` of the shard;
    the last incomplete chunk is dropped.

    Args:
        dataset_size: number of examples N (>= 1).
        rank: this worker, in ``[0, world_size)``.
        world_size: number of workers (>= 1).
        batch_size: examples per batch (>= 1).
        seed: the run seed (any int).

    Raises:
        ValueError: an argument is out of range, or a shard holds fewer than ``batch_size``
            examples (zero steps per epoch).
    """

    def __init__(self, dataset_size: int, rank: int, world_size: int, batch_size: int, seed: int):
        _require(dataset_size >= 1, f"dataset_size must be >= 1, got {dataset_size}")
        _require(world_size >= 1, f"world_size must be >= 1, got {world_size}")
        _require(0 <= rank < world_size, f"rank must be in [0, {world_size}), got {rank}")
        _require(batch_size >= 1, f"batch_size must be >= 1, got {batch_size}")
        self.dataset_size = dataset_size
        self.rank = rank
        self.world_size = world_size
        self.batch_size = batch_size
        self.seed = seed
        _require(
            self.steps_per_epoch >= 1,
            f"batch_size {batch_size} is larger than a worker's shard: dataset_size "
            f"{dataset_size} // world_size {world_size} = {self.shard_size} examples",
        )
        self._cached_epoch: int | None = None
        self._cached_indices = torch.empty(0, dtype=torch.int64)

    @property
    def shard_size(self) -> int:
        """Examples per worker per epoch: ``dataset_size // world_size``."""
        return self.dataset_size // self.world_size

    @property
    def steps_per_epoch(self) -> int:
        """Batches per worker per epoch: ``shard_size // batch_size``."""
        return self.shard_size // self.batch_size

    def batch(self, step: int) -> torch.Tensor:
        """Indices int64 ``(batch_size,)`` for global step ``step`` (>= 0), counted from epoch 0.

        The current epoch's shard is cached, so consecutive steps cost O(batch_size).
        """
        _require(step >= 0, f"step must be >= 0, got {step}")
        epoch, position = divmod(step, self.steps_per_epoch)
        start = position * self.batch_size
        return self._shard(epoch)[start : start + self.batch_size].clone()

    def stream(self, start: int, count: int) -> torch.Tensor:
        """Indices int64 ``(count,)`` at positions ``[start, start + count)`` of this worker's
        sample stream: the batches of epoch 0, then of epoch 1, and so on, so that
        ``batch(t) == stream(t * batch_size, batch_size)``. For consumers that take samples in
        other amounts than whole batches (A-BSP's partial iterations)."""
        _require(start >= 0 and count >= 0, f"start and count must be >= 0, got {start}, {count}")
        per_epoch = self.steps_per_epoch * self.batch_size
        parts = []
        while count > 0:
            epoch, position = divmod(start, per_epoch)
            k = min(count, per_epoch - position)
            parts.append(self._shard(epoch)[position : position + k])
            start, count = start + k, count - k
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def _shard(self, epoch: int) -> torch.Tensor:
        """The cached shard of ``epoch``; callers must not modify it."""
        _require(epoch >= 0, f"epoch must be >= 0, got {epoch}")
        if epoch != self._cached_epoch:
            generator = torch.Generator().manual_seed(
                (self.seed * _EPOCH_STRIDE + epoch) % _SEED_MODULUS
            )
            perm = torch.randperm(self.dataset_size, generator=generator)
            shard = perm[self.rank :: self.world_size][: self.shard_size]
            self._cached_indices = shard.contiguous()
            self._cached_epoch = epoch
        return self._cached_indices


def fetch(dataset: Dataset, indices: torch.Tensor, collate_fn=None):
    """Gather the examples at ``indices`` (int64 ``(B,)``) as one batch (a text data set's
    `TokenWindows` in one gather, as (x, y), each (B, context)).

    With no ``collate_fn``, a ``TensorDataset`` is indexed directly (one gather per tensor,
    giving a tuple of tensors with leading dimension B); any other map-style dataset goes
    through ``default_collate``, one ``dataset[i]`` call per example. With a ``collate_fn``, it
    gets the list of examples, as a ``DataLoader``'s does.

    Raises:
        IndexError: an index is out of range.
    """
    if collate_fn is None and isinstance(dataset, TensorDataset):
        return tuple(t.index_select(0, indices) for t in dataset.tensors)
    if collate_fn is None and isinstance(dataset, TokenWindows):
        return dataset.batch(indices)
    return (collate_fn or default_collate)([dataset[i] for i in indices.tolist()])


def to_device(batch, device: torch.device):
    """``batch`` (a tensor, or tuples, lists and dicts of them, as collate functions make) with
    its tensors on ``device``; other values as they are."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True) if batch.device != device else batch
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, tuple):  # a named tuple
        return type(batch)(*(to_device(b, device) for b in batch))
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def _require(condition: bool, message: str) -> None:
    """Raise ValueError(message) unless ``condition``."""
    if not condition:
        raise ValueError(message)


class ShardBatches:
    """A DataLoader's `batch_sampler` for worker `rank` of `world_size`: each pass over it is
    one epoch of `ShardSampler`'s batches (lists of `batch_size` indices), the next pass the
    next epoch, reshuffled; the same batches, in the same order, as `ako train` gives that
    worker. `set_epoch(e)` chooses the epoch of the next pass (as DistributedSampler's).

    Raises ValueError as `ShardSampler` does (a shard smaller than a batch)."""

    def __init__(self, dataset_size: int, rank: int, world_size: int, batch_size: int, seed: int = 0):
        self.sampler = ShardSampler(dataset_size, rank, world_size, batch_size, seed)
        self.batch_size = batch_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.sampler.steps_per_epoch

    def __iter__(self):
        epoch, self.epoch = self.epoch, self.epoch + 1
        first = epoch * self.sampler.steps_per_epoch
        for step in range(first, first + self.sampler.steps_per_epoch):
            yield self.sampler.batch(step).tolist()
