"""A worker's place in its data (`run.cursor.DataCursor`): whole and partial steps, mixed in any
order, take every sample of the worker's stream once, in order, the waiting ones first."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import TensorDataset

from ako.data import ShardSampler
from ako.run.cursor import DataCursor

N, WORKERS, BATCH = 200, 2, 8


def cursor(accumulate: int = 1) -> DataCursor:
    """Worker 1's cursor over a data set whose every sample is its own index."""
    indices = torch.arange(N)
    return DataCursor(TensorDataset(indices, indices), 1, WORKERS, BATCH, seed=3, accumulate=accumulate)


@settings(max_examples=80, deadline=None)
@given(steps=st.lists(st.one_of(st.none(), st.integers(1, 2 * BATCH)), min_size=1, max_size=40),
       accumulate=st.integers(1, 2))  # fmt: skip
def test_whole_and_partial_steps_take_the_stream_once_in_order(steps, accumulate):
    """None: a whole step (`next_batch`); k: a partial step that did its first k samples."""
    c = cursor(accumulate)
    step_samples = BATCH * accumulate
    done = []
    for k in steps:
        if k is None:
            batches = c.next_batch()
            assert [len(b[0]) for b in batches] == [BATCH] * accumulate
            done += torch.cat([b[0] for b in batches]).tolist()
        else:
            indices, since = c.next_assignment()
            assert len(indices) == step_samples and since.max() == c.step - 1
            count = min(k, step_samples)
            c.processed(indices, since, count)
            done += indices[:count].tolist()
    stream = ShardSampler(N, 1, WORKERS, step_samples, seed=3).stream(0, len(done))
    assert done == stream.tolist()
    assert c.step == len(steps) and c.samples == len(done)
    assert c.taken == len(done) + len(c.waiting)


def test_whole_steps_take_the_sampler_s_batches():
    c = cursor()
    sampler = ShardSampler(N, 1, WORKERS, BATCH, seed=3)
    for t in range(30):  # past an epoch's end: 100 samples a shard, 12 steps an epoch
        (x, _), = c.next_batch()
        assert torch.equal(x, sampler.batch(t))
    assert c.taken == 30 * BATCH


def test_a_checkpoint_from_before_whole_steps_counted_taken_resumes_in_place():
    c = cursor()
    for _ in range(5):
        c.next_batch()
    state = {**c.state_dict(), "taken": 0}
    resumed = cursor()
    resumed.load_state_dict(state)
    assert torch.equal(resumed.next_batch()[0][0], c.next_batch()[0][0])
