"""Per-worker shards (`ShardSampler`): disjoint, reshuffled per epoch, seeded; and `fetch`."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset, TensorDataset

from ako.data import ShardSampler, fetch


# --- sampler ----------------------------------------------------------------------------------


def shard(dataset_size, rank, world_size, seed, epoch):
    """A worker's whole shard of `epoch`: with batches of one, an epoch of its stream."""
    sampler = ShardSampler(dataset_size, rank, world_size, 1, seed)
    return sampler.stream(epoch * sampler.shard_size, sampler.shard_size)


@settings(max_examples=60, deadline=None)
@given(
    dataset_size=st.integers(1, 500),
    world_size=st.integers(1, 9),
    batch_size=st.integers(1, 8),
    seed=st.integers(-(2**70), 2**70),
    epoch=st.integers(0, 5),
)
def test_shards_are_disjoint_and_equal(dataset_size, world_size, batch_size, seed, epoch):
    shard_size = dataset_size // world_size
    if shard_size < batch_size:
        with pytest.raises(ValueError, match="larger than a worker's shard"):
            ShardSampler(dataset_size, 0, world_size, batch_size, seed)
        return
    shards = [shard(dataset_size, rank, world_size, seed, epoch) for rank in range(world_size)]
    assert all(s.shape == (shard_size,) and s.dtype == torch.int64 for s in shards)
    union = torch.cat(shards)
    assert union.unique().numel() == union.numel() == dataset_size - dataset_size % world_size
    assert union.min() >= 0 and union.max() < dataset_size


def test_epochs_differ_and_seeds_repeat():
    assert torch.equal(shard(1000, 1, 4, 7, 3), shard(1000, 1, 4, 7, 3))
    assert not torch.equal(shard(1000, 1, 4, 7, 0), shard(1000, 1, 4, 7, 1))
    assert not torch.equal(shard(1000, 1, 4, 7, 0), shard(1000, 1, 4, 8, 0))


def test_leftover_samples_change_between_epochs():
    def skipped(epoch):
        used = torch.cat([shard(10, r, 3, 0, epoch) for r in range(3)])
        return set(range(10)) - set(used.tolist())

    per_epoch = [skipped(e) for e in range(20)]
    assert all(len(s) == 1 for s in per_epoch)
    assert len(set().union(*per_epoch)) > 1
    assert ShardSampler(103, 0, 1, 1, seed=0).shard_size == 103  # one worker skips nothing


def test_batches_are_consecutive_chunks_of_the_shard():
    sampler = ShardSampler(1003, 2, 3, 16, seed=5)
    assert sampler.shard_size == 334
    assert sampler.steps_per_epoch == 20
    shards = [shard(1003, 2, 3, 5, epoch) for epoch in range(3)]
    expected = [s[i * 16 : (i + 1) * 16] for s in shards for i in range(20)]
    assert len(expected) == 60
    assert all(b.shape == (16,) and b.dtype == torch.int64 for b in expected)
    fresh = ShardSampler(1003, 2, 3, 16, seed=5)
    for step, batch in enumerate(expected):
        assert torch.equal(fresh.batch(step), batch)
    # The stream is the batches one after another, the incomplete tail of each shard dropped.
    assert torch.equal(sampler.stream(320, 320), shards[1][:320])
    # Going back to an earlier epoch is still right (cache is per epoch, not append-only).
    assert torch.equal(fresh.batch(0), expected[0])


def test_batch_caches_the_epoch_permutation(monkeypatch):
    calls = []
    randperm = torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda *a, **k: calls.append(a) or randperm(*a, **k))
    sampler = ShardSampler(1000, 0, 2, 10, seed=3)
    for step in range(2 * sampler.steps_per_epoch):
        sampler.batch(step)
    assert len(calls) == 2  # once per epoch, not once per step


def test_returned_indices_do_not_alias_the_cache():
    sampler = ShardSampler(100, 0, 2, 5, seed=1)
    first = sampler.batch(0)
    first.fill_(-1)
    assert (sampler.batch(0) >= 0).all()
    sampler.stream(0, 5).fill_(-1)
    assert (sampler.batch(0) >= 0).all()


@pytest.mark.parametrize("args, fragment", [
    ((100, 0, 4, 26, 0), "batch_size 26 is larger than a worker's shard: dataset_size 100 "
                         "// world_size 4 = 25"),
    ((100, 4, 4, 1, 0), "rank must be in"),
    ((100, -1, 4, 1, 0), "rank must be in"),
    ((100, 0, 0, 1, 0), "world_size must be >= 1"),
    ((100, 0, 1, 0, 0), "batch_size must be >= 1"),
    ((0, 0, 1, 1, 0), "dataset_size must be >= 1"),
])
def test_sampler_rejects(args, fragment):
    with pytest.raises(ValueError, match=fragment):
        ShardSampler(*args)


def test_sampler_rejects_negative_step():
    with pytest.raises(ValueError, match="step must be >= 0"):
        ShardSampler(10, 0, 1, 2, 0).batch(-1)


# --- fetch ------------------------------------------------------------------------------------


class _PlainDataset(Dataset):
    """A map-style dataset that is not a TensorDataset."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def test_fetch_fast_path_matches_generic():
    x = torch.randn(50, 1, 4, 4)
    y = torch.randint(0, 10, (50,))
    indices = torch.tensor([3, 0, 49, 3, 17])
    fast_x, fast_y = fetch(TensorDataset(x, y), indices)
    slow_x, slow_y = fetch(_PlainDataset(x, y), indices)
    assert torch.equal(fast_x, slow_x) and torch.equal(fast_y, slow_y)
    assert fast_y.dtype == slow_y.dtype == torch.int64
    assert torch.equal(fast_x, x[indices]) and torch.equal(fast_y, y[indices])


def test_fetch_gives_every_tensor_of_a_tensor_dataset_and_uses_a_collate_fn():
    a, b, c = torch.arange(6.0), torch.arange(6) * 10, torch.arange(6) * 100
    indices = torch.tensor([4, 1])
    assert [t.tolist() for t in fetch(TensorDataset(a, b, c), indices)] == [[4.0, 1.0], [40, 10], [400, 100]]
    batch = fetch(TensorDataset(a, b), indices, collate_fn=lambda items: {"n": len(items), "first": items[0]})
    assert batch["n"] == 2 and batch["first"][1].item() == 40
