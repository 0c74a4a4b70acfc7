"""All-reduce that overlaps backward (`ops.ComputeAllReduce`): the buckets, that they start
while backward runs, that any bucketing gives the same replicas in both runtimes, and the
simulator's hand-computed schedule."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import ako
from ako.data import fetch, load_dataset
from ako.models import build_model
from ako.runtime.distributed.runtime import _Buckets
from ako.runtime.simulated.costs import Costs, ring_bytes
from ako.strategies import Strategy
from ako.strategies.ops import AllReduce, Compute, ComputeAllReduce
from helpers import make_replica, small_config

# the cnn on 8x8 digits: its 8 tensors' offsets (conv 144 + 16, conv 4608 + 32, fc 16384 + 128, fc 1280 + 10)
BOUNDARIES = [0, 144, 160, 4768, 4800, 21184, 21312, 22592, 22602]
NUMEL = BOUNDARIES[-1]


def digits_replica():
    torch.manual_seed(0)
    return make_replica(build_model("cnn", (1, 8, 8), 10), ako.TrainConfig())


def test_buckets_hold_whole_tensors_last_first_and_the_slot():
    replica = digits_replica()
    assert replica.boundaries == BOUNDARIES
    assert replica.buckets(1 << 30) == [(0, NUMEL + 1)]  # one bucket
    assert replica.buckets(0) == [(22592, 22603), (21312, 22592), (21184, 21312), (4800, 21184), (4768, 4800),
                                  (160, 4768), (144, 160), (0, 144)]  # fmt: skip
    # 20 kB: the last fc layer and the slot (5,164 B) are too few, the first fc's weight closes it
    assert replica.buckets(20_000) == [(4800, 22603), (0, 4800)]
    assert replica.grad_and_slot.data_ptr() == replica.grad.data_ptr()
    assert replica.slot.data_ptr() == replica.grad[-1:].data_ptr() + 4


class _RecordingRuntime:
    """Stands in for `DistributedRuntime` in `_Buckets`: records each all-reduce started and
    which tensors' gradients were final by then."""

    def __init__(self):
        self.started, self.final = [], []

    def all_reduce(self, tensor, reduce="sum", wait=True):
        self.started.append((tensor.data_ptr(), tensor.numel(), len(self.final)))
        return tensor

    def _wait(self, handle):
        return handle


def test_bucket_all_reduces_start_in_order_while_backward_runs():
    """A bucket per tensor: each starts as soon as its tensor's gradient is final, in bucket
    order (a conv's bias is finished after its weight, so both start after the weight), and
    the first ones start while backward has tensors left to do."""
    replica = digits_replica()
    runtime = _RecordingRuntime()
    buckets = _Buckets(runtime, replica, 0)
    buckets.begin(lambda: None)
    split = load_dataset("digits", train_samples=64)
    batch = fetch(split.train, torch.arange(16))

    def ready(i):
        runtime.final.append(i)
        buckets.ready(i)

    replica.compute_gradient([batch], ready=ready)
    buckets.finish()
    base = replica.grad_and_slot.data_ptr()
    spans = [((ptr - base) // 4, (ptr - base) // 4 + n) for ptr, n, _ in runtime.started]
    assert spans == replica.buckets(0)
    assert sorted(runtime.final) == list(range(8))
    assert runtime.started[0][2] < 8  # the first bucket left before the last gradient was final
    finals_at_start = [done for _, _, done in runtime.started]
    assert finals_at_start == sorted(finals_at_start)


class _Bucketed:
    """`allreduce`'s program with buckets of `bucket_bytes` (a class: it pickles to the workers)."""

    def __init__(self, bucket_bytes: int):
        self.bucket_bytes = bucket_bytes

    def __call__(self, ctx):
        steps = 0
        while True:
            g = yield ComputeAllReduce(self.bucket_bytes)
            ctx.replica.step(g.grad.div_(ctx.world_size))
            steps += 1
            if g.stopping:
                return {"steps": steps}


def _after_backward(ctx):
    """The reference: compute, then one all-reduce of the gradient and the stop vote."""
    buf = ctx.replica.params.new_empty(ctx.replica.numel + 1)
    steps = 0
    while True:
        g = yield Compute()
        buf[:-1].copy_(g.grad)
        buf[-1] = float(ctx.stopping)
        yield AllReduce(buf)
        ctx.replica.step(buf[:-1].div_(ctx.world_size))
        steps += 1
        if buf[-1] > 0:
            return {"steps": steps}


PER_TENSOR = Strategy(name="allreduce", worker=_Bucketed(0), lockstep=True)
TWO_BUCKETS = Strategy(name="allreduce", worker=_Bucketed(20_000), lockstep=True)
AFTER_BACKWARD = Strategy(name="allreduce", worker=_after_backward, lockstep=True)


def test_any_bucketing_gives_the_replicas_of_one_all_reduce_after_backward(tmp_path):
    """2 workers, 2 micro-batches a step (the hooks fire on the last one only), worker 1 a
    straggler (its delays fall before each bucket): a bucket per tensor, two buckets, and one
    all-reduce after backward give the same replicas bit for bit, and as many steps; and the
    simulator gives them too."""
    config = small_config(tmp_path, strategy="allreduce", accumulate=2, batch_size=8, straggler=("rank=1,factor=2",))
    reference = ako.train(config, strategy=AFTER_BACKWARD)
    steps = reference.summary["per_worker"][0]["steps"]
    assert steps == 6
    for strategy in (PER_TENSOR, TWO_BUCKETS):
        result = ako.train(config, strategy=strategy)
        assert result.summary["per_worker"][0]["steps"] == steps
        for r, w in zip(reference.workers, result.workers):
            assert torch.equal(r.params, w.params)
    simulated = ako.simulate(replace(config, seconds_per_sample=1e-3), strategy=PER_TENSOR)
    for r, w in zip(reference.workers, simulated.workers):
        assert torch.equal(r.params, w.params)


def test_the_stop_vote_ends_every_worker_at_the_same_step(tmp_path):
    """The built-in `allreduce` with a target that rank 0 reaches: the workers agree on the
    last step through the vote in the first bucket."""
    config = small_config(tmp_path, strategy="allreduce", epochs=20.0, eval_every=0.5, lr=0.05, target="loss<=1.0")
    result = ako.train(config)
    steps = [w["steps"] for w in result.summary["per_worker"]]
    assert steps[0] == steps[1] < 240 and result.summary["test_loss"] <= 1.0


def _ready_schedule(ready, n_steps, compute, slow_compute, bandwidth, latency, n=2):
    """The simulator's schedule by hand: each step every worker computes (the straggler for
    `slow_compute`), and bucket j's ring all-reduce starts when the slower worker has it ready
    and the previous bucket has left the links; the step ends with the last bucket."""
    costs = Costs(1.0, bandwidth, latency)
    buckets = digits_replica().buckets(0)
    fractions = Costs(1.0, gradient_ready=ready).bucket_ready(BOUNDARIES, buckets)
    t = 0.0
    for _ in range(n_steps):
        links_free, end = t, t
        for (lo, hi), f in zip(buckets, fractions):
            start = max(t + f * max(compute, slow_compute), links_free)
            links_free = start + costs.transfer_seconds(ring_bytes((hi - lo) * 4, n))
            end = links_free + 2 * (n - 1) * latency
        t = end
    return t


@pytest.mark.parametrize("straggler", [(), ("rank=1,factor=3",)], ids=["even", "straggler"])
def test_the_simulator_charges_each_bucket_from_when_it_was_ready(tmp_path, straggler):
    """A profile's gradient_ready fractions, a bucket per tensor, 10 MB/s links, 100 us: the
    run's virtual time is the hand-computed schedule's, and shorter than computing and then
    all-reducing (the reference strategy)."""
    ready = [1.0, 1.0, 0.9, 0.9, 0.6, 0.6, 0.5, 0.5]
    profile = tmp_path / "cnn.toml"
    profile.write_text(f"model = 'cnn'\nbatch_size = 16\nseconds_per_sample = 1e-3\ngradient_ready = {ready}\n")
    config = small_config(tmp_path, strategy="allreduce", profile=str(profile), bandwidth="10MB", latency="100us",
                          straggler=straggler)  # fmt: skip
    result = ako.simulate(config, strategy=PER_TENSOR)
    c = 0.016
    slow = 3 * c if straggler else c
    expected = _ready_schedule(ready, 6, c, slow, 1e7, 1e-4)
    assert result.summary["simulation"]["rank0_seconds"] == pytest.approx(expected, rel=1e-12)
    after = ako.simulate(config, strategy=AFTER_BACKWARD).summary["simulation"]["rank0_seconds"]
    assert after == pytest.approx(6 * (slow + ring_bytes(NUMEL * 4 + 4, 2) / 1e7 + 2e-4), rel=1e-12)
    assert expected < after


def test_without_a_profile_forward_takes_a_third_and_backward_finishes_tensors_last_first():
    fractions = Costs(1.0).bucket_ready(BOUNDARIES, digits_replica().buckets(0))
    assert fractions == pytest.approx([1 / 3 + 2 / 3 * k / 8 for k in range(1, 9)])
    with pytest.raises(ValueError, match="gradient_ready has 2 fractions, the model 8"):
        Costs(1.0, gradient_ready=(0.5, 1.0)).bucket_ready(BOUNDARIES, [(0, NUMEL + 1)])


def test_a_profile_measured_for_other_tensors_is_one_line(tmp_path, capsys):
    """gradient_ready of another length than the model's tensors: exit 2 with one line, before
    the simulation starts, and no run folder."""
    from ako.cli import main

    profile = tmp_path / "short.toml"
    profile.write_text("seconds_per_sample = 1e-4\ngradient_ready = [0.5, 1.0]\n")
    code = main(["simulate", "--strategy", "allreduce", "--dataset", "digits", "--train-samples", "384",
                 "--epochs", "0.2", "--profile", str(profile), "--out-dir", str(tmp_path / "run"), "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "gradient_ready has 2 fractions, the model 8 parameter tensors" in err
    assert not (tmp_path / "run").exists()
