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


def cursor(accumulate: int = 1, num_workers: int = 0) -> DataCursor:
    """Worker 1's cursor over a data set whose every sample is its own index."""
    indices = torch.arange(N)
    return DataCursor(TensorDataset(indices, indices), 1, WORKERS, BATCH, seed=3, accumulate=accumulate, num_workers=num_workers)


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
    assert c.cut == sum(1 for k in steps if k is not None and k < step_samples)


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
    del state["cut"]
    resumed = cursor()
    resumed.load_state_dict(state)
    assert torch.equal(resumed.next_batch()[0][0], c.next_batch()[0][0])


def test_the_loader_goes_on_from_where_partial_steps_left_the_stream():
    """With a DataLoader (`num_workers`), whole steps after a partial one are loaded ahead
    again, from the stream's new position: the samples are those without one."""
    with_loader, plain = cursor(num_workers=1), cursor()
    for c in (with_loader, plain):
        c.next_batch()
        indices, since = c.next_assignment()
        c.processed(indices, since, 3)
    assert [with_loader.next_batch()[0][0].tolist() for _ in range(4)] == [plain.next_batch()[0][0].tolist() for _ in range(4)]
    assert with_loader._loaded is not None and with_loader._loaded[0] == with_loader.taken


def test_a_checkpoint_keeps_the_partial_steps_count():
    c = cursor()
    indices, since = c.next_assignment()
    c.processed(indices, since, 5)
    resumed = cursor()
    resumed.load_state_dict(c.state_dict())
    assert (resumed.cut, resumed.samples, resumed.taken, resumed.waiting.tolist()) == (1, 5, BATCH, indices[5:].tolist())
