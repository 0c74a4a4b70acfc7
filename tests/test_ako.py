"""Ako's delay-tolerant partial exchange (strategies/ako.py): equal to all-reduce at p = 1 and
staleness 0, conserving with p > 1, its ledger bounded by the staleness bound, a lost peer
waited on by nothing, p = auto capped at P_MAX, and the better model handed back. Both
exchanges; both runtimes where it applies."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import ako
from ako.run.job import Job
from ako.strategies import STRATEGIES, Strategy
from ako.strategies import ako as ako_strategy
from ako.strategies.ops import Message
from ako.strategies.partition import partition_bounds
from ako.strategies.tags import AKO_WINDOW
from helpers import RECORDED_AKO, single_process_sgd, small_config

EXCHANGES = ["all-to-all", "ring"]
NUMEL = 22_602  # the cnn on 8x8 digits
G = NUMEL * 4  # bytes of one flat gradient


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread in this process, as each distributed worker runs (the simulator
    computes here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def params_of(result):
    return [w.params for w in result.workers]


@pytest.fixture(scope="module")
def allreduce_reference(tmp_path_factory):
    """12 steps of all-reduce SGD with momentum 0.9, Nesterov and weight decay 1e-3."""
    return ako.train(small_config(tmp_path_factory.mktemp("allreduce"), strategy="allreduce", epochs=1.0))


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_one_partition_lock_step_equals_allreduce(tmp_path, allreduce_reference, exchange):
    """p = 1, s = 0: each worker's own momentum step, swapped for the mean of all workers'
    steps, is all-reduce's momentum step on the mean gradient (momentum is linear)."""
    config = small_config(tmp_path, strategy="ako", partitions=1, staleness=0, exchange=exchange, epochs=1.0)
    result = ako.train(config)
    assert result.summary["partitions"] == 1 and result.summary["exchange"] == exchange
    for params in params_of(result):
        torch.testing.assert_close(params, allreduce_reference.workers[0].params, rtol=0, atol=1e-5)
    simulated = ako.simulate(replace(config, seconds_per_sample=1e-3, latency="50us", bandwidth="10MB"))
    for params in params_of(simulated):
        torch.testing.assert_close(params, allreduce_reference.workers[0].params, rtol=0, atol=1e-5)


def test_a_partition_boundary_falls_inside_a_tensor(tmp_path):
    """The conservation tests' p = 7 splits a tensor and does not divide the parameter count."""
    job = Job(small_config(tmp_path))
    replica = job.build_replica(job.load_data(), torch.device("cpu"))
    cuts = [lo for lo, _ in partition_bounds(replica.numel, 7, replica.boundaries)]
    assert replica.numel % 7 != 0 and any(c not in replica.boundaries for c in cuts)


CONSERVATION = [("all-to-all", 7, 0), ("all-to-all", 7, 2), ("ring", 7, 1), ("ring", 3, 0)]


@pytest.mark.parametrize("exchange,partitions,staleness", CONSERVATION)
def test_no_update_is_lost_in_the_simulator(tmp_path, exchange, partitions, staleness):
    """Plain SGD: w_end = w_0 - lr/n x (the sum of every gradient of every worker) on every
    replica after the flush, with a straggler making the arrival order uneven (and, with s > 0,
    taking partial steps)."""
    partials = _check_conservation(ako.simulate, tmp_path, exchange, partitions, staleness, seconds_per_sample=1e-3, bandwidth="5MB")
    assert (sum(partials) > 0) == (staleness > 0), partials  # the straggler's


@pytest.mark.parametrize("exchange,partitions,staleness", [("all-to-all", 7, 2), ("ring", 7, 1)])
def test_no_update_is_lost_on_real_processes(tmp_path, exchange, partitions, staleness):
    _check_conservation(ako.train, tmp_path, exchange, partitions, staleness)


def _check_conservation(run, tmp_path, exchange, partitions, staleness, **costs):
    lr, n = 0.05, 3
    config = small_config(
        tmp_path, strategy="ako", workers=n, train_samples=3 * 16 * 8, exchange=exchange, partitions=partitions,
        staleness=staleness, momentum=0.0, weight_decay=0.0, lr=lr, epochs=1.0, straggler=("rank=1,factor=3",), **costs,
    )  # fmt: skip
    start = single_process_sgd(config, 0)
    result = run(config, strategy=RECORDED_AKO)
    total = sum(w.facts["grad_sum"] for w in result.workers)
    # to the planned end, every exchange stops at the planned step (no vote to wait for)
    assert total.abs().sum() > 0 and result.summary["iterations"] == 8
    for w in result.workers:
        applied = (start.double() - w.params.double()) * n / lr
        torch.testing.assert_close(applied, total, rtol=0, atol=2e-4)
    return [w.facts.get("partials", 0) for w in result.workers]


def _lr0(ctx):
    for group in ctx.replica.optimizer.optimizer.param_groups:
        group["lr"] = 0.0
    return (yield from ako_strategy.worker(ctx))


AKO_LR0 = Strategy(name="ako", worker=_lr0, replicas_differ=True, check=ako_strategy.check)


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_learning_rate_zero_leaves_every_replica_where_it_started(tmp_path, exchange):
    """With momentum and weight decay but lr 0, no window or correction moves a replica."""
    config = small_config(tmp_path, strategy="ako", workers=3, exchange=exchange, partitions=4, seconds_per_sample=1e-3)  # p = steps
    start = single_process_sgd(config, 0)
    for params in params_of(ako.simulate(config, strategy=AKO_LR0)):
        assert torch.equal(params, start)


def test_replicas_agree_after_the_flush_with_momentum(tmp_path):
    """Momentum 0.9, Nesterov, weight decay, p = 7, s = 2, a straggler: replicas differ while
    training and are the same model after the flush (to float rounding)."""
    config = small_config(
        tmp_path, strategy="ako", workers=3, exchange="all-to-all", partitions=7, staleness=2, epochs=1.0,
        eval_every=0.25, straggler=("rank=2,factor=3",), seconds_per_sample=1e-3,
    )  # fmt: skip
    result = ako.simulate(config)
    records = [json.loads(line) for line in (Path(result.summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert max(r["consensus_distance"] for r in records[:-1]) > 1e-4  # apart while training
    assert result.summary["consensus_distance"] < 1e-6
    assert result.summary["consensus_distance_max"] == max(r["consensus_distance"] for r in records)  # the summary says so
    first = result.workers[0].params
    for params in params_of(result)[1:]:
        torch.testing.assert_close(params, first, rtol=0, atol=1e-6)


class _Measured(ako_strategy.Ledger):
    """A ledger that notes the most own windows it ever held (class-wide: one process)."""

    most = 0

    def sent(self, *args):
        super().sent(*args)
        _Measured.most = max(_Measured.most, len(self.own))


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_the_ledger_never_holds_more_than_the_staleness_bound_allows(tmp_path, monkeypatch, staleness):
    """A straggler at factor 4 makes the bound bite: the fast workers wait, and no worker ever
    keeps more than s + 1 own windows waiting for its peers' (the flush's entry included)."""
    monkeypatch.setattr(ako_strategy, "Ledger", _Measured)
    _Measured.most = 0
    config = small_config(
        tmp_path, strategy="ako", workers=3, exchange="all-to-all", partitions=3, staleness=staleness,
        epochs=1.0, straggler=("rank=1,factor=4",), seconds_per_sample=1e-3,
    )  # fmt: skip
    result = ako.simulate(config)
    assert result.summary["staleness_bound"] == staleness
    assert _Measured.most == staleness + 1
    assert result.summary["per_worker"][0]["idle_seconds"] > 0.01  # the bound bites: it waits for the straggler


@pytest.mark.parametrize("latency,staleness,expected", [("2ms", None, 1), ("10ms", "auto", 3), ("100ms", None, 4),
                                                        ("100ms", 2, 2)])  # fmt: skip
def test_staleness_auto_covers_a_windows_all_reduce_on_the_ring(tmp_path, latency, staleness, expected):
    """With an outer step (AdamW, the ring) s = auto is the fewest steps that hide a window's
    all-reduce, at most 4 (unset or "auto"); a given --staleness stands. 3 workers on a free link: the ring takes
    2 (n - 1) x latency = 4 x latency, a step 16 samples x 1 ms, so s >= (4 x latency + 16 ms) /
    16 ms - 1: 8/16 at 2 ms (s = 1), 40/16 at 10 ms (s = 3), 400/16 at 100 ms (the cap, 4)."""
    config = small_config(tmp_path, strategy="ako", workers=3, optimizer="adamw", lr=3e-3, momentum=None, partitions=2,
                          staleness=staleness, seconds_per_sample=1e-3, latency=latency)  # fmt: skip
    result = ako.simulate(config)
    assert (result.summary["exchange"], result.summary["staleness_bound"]) == ("ring", expected)
    assert ("staleness s = " in result.summary["partitions_reason"]) == (staleness in (None, "auto"))
    assert torch.equal(result.workers[0].params, result.workers[2].params)  # every window settled, however late


def _window(src: int, step: int, part: int, value: float) -> Message:
    return Message(src, AKO_WINDOW, step, part, torch.full((2,), value))


def test_a_lost_peer_leaves_nothing_waited_on():
    """Worker 0 of 3, two partitions of 2 coordinates. Peer 2 dies after sending step 0: the
    windows it owed are settled as zeros, nothing waits for it, and the replica ends at
    (own + peer 1's + what peer 2 delivered) / n, as peer 1's would."""
    params = torch.zeros(4)
    ledger = ako_strategy.Ledger([1, 2], 3, params, [(0, 2), (2, 4)])
    own = [1.0, 2.0, 3.0]
    for t, value in enumerate(own):  # the own steps: applied at once, at full weight
        lo, hi = (0, 2) if t % 2 == 0 else (2, 4)
        params[lo:hi] += value
        ledger.sent(t, lo, hi, torch.full((2,), value))
        if t == 0:
            ledger.add(_window(2, 0, 0, 10.0))
            ledger.drop(2)
            assert ledger.slowest() == -1  # only peer 1 is waited for now
        ledger.add(_window(1, t, t % 2, 100.0 * (t + 1)))
        ledger.settle(up_to=t)
    assert not ledger.own  # every own window settled by both peers
    ledger.sent(1 << 62, 0, 4, torch.zeros(4))
    ledger.add(Message(1, AKO_WINDOW, 3, ako_strategy.FLUSH, torch.zeros(4)))
    ledger.settle(up_to=1 << 62)
    assert ledger.all_flushed() and not ledger.own and not ledger.pending
    expected = torch.tensor([1 + 3 + 100 + 300 + 10, 0, 2 + 200, 0])[[0, 0, 2, 2]] / 3
    torch.testing.assert_close(params, expected.float())


def _auto_run(tmp_path, n: int, batch_size: int, accumulate: int) -> tuple[dict, float]:
    """A simulated all-to-all run at 20 MB/s, steps of 8 ms: (summary, bytes sent per second).
    At least 80 steps (fewer epochs below 16 workers, whose epochs have more steps)."""
    config = small_config(
        tmp_path, strategy="ako", workers=n, exchange="all-to-all", train_samples=None, batch_size=batch_size,
        accumulate=accumulate, epochs=8.0 * accumulate * min(1, n / 16), eval_every=1.0,
        seconds_per_sample=8e-3 / (batch_size * accumulate),
        bandwidth="20MB",
    )  # fmt: skip
    summary = ako.simulate(config).summary
    log = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    first, last = log[0], log[-2]  # the last record comes after the flush
    return summary, (last["bytes_sent"] - first["bytes_sent"]) / (last["time"] - first["time"])


def test_auto_caps_p_and_says_when_the_link_binds(tmp_path):
    """All-to-all at 20 MB/s, 16 samples (2 micro-batches of 8) of 8 ms a step: p =
    ceil((n-1) G / (B c)) while that is at most P_MAX = 8, and the bytes a worker sends stay
    within the link budget; from 16 workers on the budget asks for more (9, then 18), p stays 8,
    the summary says the run is link-bound, and the link is what paces it: the bytes per second
    reach the link rate. Below SMALL_BATCH = 16 samples a step the cap is 4."""
    bandwidth = 20e6
    assert (ako_strategy.P_MAX, ako_strategy.P_MAX_SMALL_BATCH, ako_strategy.SMALL_BATCH) == (8, 4, 16)
    partitions, rates = [], []
    for n in (4, 8, 16, 32):
        summary, rate = _auto_run(tmp_path, n, batch_size=8, accumulate=2)
        partitions.append(summary["partitions"])
        rates.append(rate)
        assert summary["partitions_reason"].startswith("link-bound" if n >= 16 else "auto")
    assert partitions == [2, 4, 8, 8]  # ceil((n-1) x 90408 / 160000) = 2, 4, 9, 18; capped at 8
    assert all(rate <= bandwidth * 1.05 for rate in rates), rates  # bytes count when sent: a window or two of 40 steps ahead
    assert rates[2] == pytest.approx(bandwidth, rel=0.05) and rates[3] == pytest.approx(bandwidth, rel=0.05)
    summary, rate = _auto_run(tmp_path, 16, batch_size=8, accumulate=1)
    assert summary["partitions"] == 4 and summary["partitions_reason"].startswith("link-bound: the link budget asks for p = 9, capped at 4")
    assert rate == pytest.approx(bandwidth, rel=0.05)



def test_auto_with_an_outer_step_takes_8_to_100_partitions_and_fewer_for_small_steps():
    """With an outer step p = auto is the link's p raised to at least 8 and capped at 100, and
    at 4 x a step's samples (`p_outer`): on the ring at 4 workers a gradient of G = 361632 bytes
    needs 1.5 G = 542448 bytes a step, against B x T_step = 160 kB at 20 MB/s (p = 4, raised to
    8), 16 kB at 2 MB/s (p = 34) and 1.6 kB at 0.2 MB/s (340, capped at 100: link-bound); with
    8 samples a step the cap is 32, with 2 it is the floor 8."""
    assert [ako_strategy.p_outer(samples) for samples in (64, 25, 16, 8, 2, 1)] == [
        (8, 100), (8, 100), (8, 64), (8, 32), (8, 8), (8, 8)]  # fmt: skip
    G, numel = 361632, 90408
    plans = [ako_strategy.Budget(b, 0.008, "given", *ako_strategy.p_outer(32)).partitions("ring", 4, G, numel)
             for b in (20e6, 2e6, 0.2e6)]  # fmt: skip
    assert [p for p, _ in plans] == [8, 34, 100]
    assert plans[0][1].endswith("so p = ceil(3.39) = 4, raised to 8: an outer step needs windows of at least 8 steps (fewer trained worse)")
    assert plans[1][1].endswith("so p = ceil(33.90) = 34")
    assert plans[2][1].startswith("link-bound: the link budget asks for p = 340, capped at 100")
    p, why = ako_strategy.Budget(2e6, 0.008, "given", *ako_strategy.p_outer(8)).partitions("ring", 4, G, numel)
    assert p == 32 and why.startswith("link-bound: the link budget asks for p = 34, capped at 32")


def test_compress_auto_sends_int8_windows_only_where_float32_would_be_link_bound():
    """`--compress auto`: float32 where p = auto fits the link within its cap, int8 where it
    would not, with p from int8's bytes; a given code stands. 4 workers on the ring, 90408
    values: 1.5 x 361632 = 542448 bytes a step at float32 and 1.5 x (90408 + 4 x 707) = 139854
    at int8, against B x T_step = 16 kB at 2 MB/s (p = 34 within the cap of 100: float32),
    1.6 kB at 0.2 MB/s (340 at float32, so int8's 88) and 0.4 kB at 0.05 MB/s (350 at int8,
    still capped at 100: link-bound)."""
    numel = 90408

    def plan(bandwidth, compress="auto"):
        return ako_strategy.code_for(compress, ako_strategy.Budget(bandwidth, 0.008, "given", 8, 100), "ring", 4, numel)

    p, why, codec = plan(2e6)
    assert (p, codec.name) == (34, "none") and "int8" not in why
    p, why, codec = plan(0.2e6)
    assert (p, codec.name) == (88, "int8")
    assert why.startswith("auto: ") and "so p = ceil(87.41) = 88; the bytes are int8's: --compress auto takes int8 windows, as float32 ones would be link-bound (p = 340 > 100)" in why
    p, why, codec = plan(0.05e6)
    assert (p, codec.name) == (100, "int8") and why.startswith("link-bound: the link budget asks for p = 350, capped at 100")
    assert plan(0.2e6, "none")[::2] == (100, ako_strategy.CODECS["none"])  # as given, link-bound or not
    assert plan(2e6, "bf16")[::2] == (17, ako_strategy.CODECS["bf16"])


def test_compress_auto_in_a_link_bound_simulation_sends_int8_windows_and_ends_with_equal_replicas(tmp_path):
    """3 workers with AdamW (the ring, an outer step) on a link too slow for float32 windows at
    p's cap: the plan takes int8 and every window and the flush settle (equal replicas). With
    sgd (the plain swap) auto stays float32."""
    runs = {}
    for compress in ("auto", "none"):
        config = small_config(tmp_path / compress, strategy="ako", workers=3, optimizer="adamw", lr=3e-3, momentum=None,
                              seconds_per_sample=1e-4, bandwidth="1Mbit", compress=None if compress == "auto" else compress)  # fmt: skip
        runs[compress] = ako.simulate(config)
    auto, none = runs["auto"].summary, runs["none"].summary
    assert (auto["compress"], none["compress"]) == ("int8", "none")
    assert (auto["windows"], none["windows"]) == ("deltas with an outer step (lr 0.8, momentum 0.6), sent as int8",
                                                  "deltas with an outer step (lr 0.8, momentum 0.6)")  # fmt: skip
    assert none["partitions_reason"].startswith("link-bound") and "takes int8 windows" in auto["partitions_reason"]
    assert torch.equal(runs["auto"].workers[0].params, runs["auto"].workers[2].params)
    plain = ako.simulate(small_config(tmp_path / "sgd", strategy="ako", workers=3, seconds_per_sample=1e-4, bandwidth="1Mbit"))
    assert plain.summary["compress"] == "none" and plain.summary["partitions_reason"].startswith("link-bound")


def test_staleness_auto_is_at_least_2_for_compressed_windows(tmp_path):
    """A compressed mean goes in two halves, the second a step after the first: s = auto is
    at least 2 for lossy windows, where float32 ones take 1 (3 workers, a free link, 2 ms of
    latency: the case of s = 1 above)."""
    for compress, expected in (("none", 1), ("int8", 2)):
        config = small_config(tmp_path / compress, strategy="ako", workers=3, optimizer="adamw", lr=3e-3, momentum=None,
                              partitions=2, seconds_per_sample=1e-3, latency="2ms", compress=compress)  # fmt: skip
        result = ako.simulate(config)
        assert result.summary["staleness_bound"] == expected
        assert ("at least 2 for int8 windows" in result.summary["partitions_reason"]) == (compress == "int8")
        assert torch.equal(result.workers[0].params, result.workers[2].params)


def test_staleness_auto_without_compute_or_link_time_takes_the_cap(tmp_path):
    """Steps that take no time (no --seconds-per-sample, a free link) leave only the ring's
    latency: s = auto is the cap, 4, and the run ends with equal replicas."""
    config = small_config(tmp_path, strategy="ako", workers=3, optimizer="adamw", lr=3e-3, momentum=None,
                          seconds_per_sample=0.0, latency="50us")  # fmt: skip
    result = ako.simulate(config)
    assert result.summary["staleness_bound"] == 4
    assert torch.equal(result.workers[0].params, result.workers[2].params)


def test_the_default_outer_step_is_diloco_s_from_8_workers_and_shorter_below():
    """With AdamW on the ring: lr 0.8, momentum 0.6 at 2 to 7 workers, DiLoCo's 0.7 and 0.9 from 8
    (docs/results.md); sgd's plain swap, AdamW's windows of gradients on all-to-all and at one
    worker; --outer-lr and --outer-momentum override each value alone."""
    forms = [ako_strategy.default_form(True, "auto", n) for n in (1, 2, 7, 8, 64)]
    assert forms == [("gradients", (1.0, 0.0)), ("deltas", (0.8, 0.6)), ("deltas", (0.8, 0.6)),
                     ("deltas", (0.7, 0.9)), ("deltas", (0.7, 0.9))]  # fmt: skip
    assert ako_strategy.default_form(False, "auto", 64) == ("deltas", (1.0, 0.0))
    assert ako_strategy.default_form(True, "all-to-all", 4) == ("gradients", (1.0, 0.0))
    assert ako_strategy.default_form(True, "ring", 8, outer_momentum=0.5) == ("deltas", (0.7, 0.5))
    assert ako_strategy.default_form(True, "ring", 4, outer_lr=1.0) == ("deltas", (1.0, 0.6))


def test_the_plans_measurements_are_not_training_time(monkeypatch):
    """`MeasureStep` and `MeasureBandwidth` (p = auto's step time and link) pause the real
    runtime's training clock, as the simulator charges them no virtual time: 0.2 s each of
    measuring leave the training seconds at about 0 and the wall seconds at 0.4 or more."""
    import time

    from ako.runtime.base import run_blocking
    from ako.runtime.distributed.runtime import DistributedRuntime, WallClock
    from ako.strategies.ops import MeasureBandwidth, MeasureStep

    runtime = object.__new__(DistributedRuntime)  # no process group: only the clock and the two measurements
    runtime.clock = WallClock()
    runtime.clock.begin()
    monkeypatch.setattr(runtime, "measure_step", lambda: time.sleep(0.2) or 0.01)
    monkeypatch.setattr(runtime, "measure_bandwidth", lambda probe_bytes: time.sleep(0.2) or 1e6)
    assert run_blocking(runtime.execute(MeasureStep())) == 0.01
    assert run_blocking(runtime.execute(MeasureBandwidth(1024))) == 1e6
    assert runtime.clock.wall() >= 0.4
    assert runtime.clock.now() < 0.05


def _broken_flush(ctx):
    """Ako, and then a flush gone wrong: the final replicas are zeroed."""
    facts = yield from ako_strategy.worker(ctx)
    ctx.replica.params.zero_()
    return facts


def test_the_better_model_is_handed_back(tmp_path):
    """When the flush makes the replicas worse than rank 0's replica before it, the run hands
    back rank 0's and says so; otherwise the flushed replicas."""
    config = small_config(tmp_path, strategy="ako", epochs=2.0, seconds_per_sample=1e-3, test_samples=200)
    good = ako.simulate(config)
    chosen = good.summary["final_model"]
    after = chosen["flushed_accuracy"] >= chosen["unflushed_accuracy"]
    assert chosen["source"] == ("the replicas after the flush" if after else "rank 0's replica before the flush")
    assert chosen["test_accuracy"] == max(chosen["flushed_accuracy"], chosen["unflushed_accuracy"])
    assert torch.equal(good.model, good.workers[0].params if after else good.workers[0].facts["unflushed"])
    broken = ako.simulate(config, strategy=replace(STRATEGIES["ako"], worker=_broken_flush))
    chosen = broken.summary["final_model"]
    assert chosen["source"] == "rank 0's replica before the flush"
    assert chosen["test_accuracy"] == chosen["unflushed_accuracy"] > chosen["flushed_accuracy"]
    assert torch.equal(broken.model, broken.workers[0].facts["unflushed"]) and broken.model.abs().sum() > 0


def test_bytes_per_step_are_n_minus_1_windows_over_p(tmp_path):
    """All-to-all: each step sends partition (t mod p) to the n-1 peers; with t a multiple of p
    that is (n-1) x gradient bytes / p per step, plus the final flush (one gradient per peer)
    and after it whether a peer was lost (one byte per peer)."""
    n, p = 3, 4
    config = small_config(
        tmp_path, strategy="ako", workers=n, exchange="all-to-all", partitions=p, train_samples=3 * 16 * 8, epochs=1.0
    )
    result = ako.train(config)
    for w in result.summary["per_worker"]:
        assert w["steps"] == 8
        assert w["bytes_sent"] == 8 * (n - 1) * G // p + (n - 1) * G + (n - 1)
        assert w["bytes_received"] == w["bytes_sent"]


@pytest.mark.parametrize("staleness", [0, 1])
def test_workers_that_stop_at_different_steps_finish(tmp_path, staleness):
    """The target reached on rank 0 stops the others a latency later, some steps apart: a peer
    waiting on a finished worker's next window must take its flush as its last word."""
    config = small_config(
        tmp_path, strategy="ako", workers=4, exchange="all-to-all", staleness=staleness, train_samples=None,
        epochs=20.0, eval_every=0.05, target_accuracy=0.5, seconds_per_sample=1e-3, latency="50us", bandwidth="10MB",
    )  # fmt: skip
    summary = ako.simulate(config).summary
    steps = [w["steps"] for w in summary["per_worker"]]
    assert summary["time_to_accuracy"]["0.5"] is not None and len(set(steps)) > 1
    assert summary["consensus_distance"] < 1e-6


def test_the_ring_stops_together_on_the_target_and_at_the_planned_step(tmp_path):
    """The ring's workers vote to stop early (the target) and all stop at one step, before the
    plan's end; a run to its end stops at the planned step itself (no step past --epochs)."""
    common = dict(strategy="ako", workers=4, exchange="ring", staleness=1, seconds_per_sample=1e-3, bandwidth="10MB")
    early = ako.simulate(small_config(tmp_path, train_samples=None, epochs=20.0, eval_every=0.05, target_accuracy=0.5,
                                      **common)).summary  # fmt: skip
    steps = {w["steps"] for w in early["per_worker"]}
    assert early["time_to_accuracy"]["0.5"] is not None and len(steps) == 1 and early["iterations"] < 20 * 22
    whole = ako.simulate(small_config(tmp_path, epochs=1.0, **common)).summary  # 384 / 4 / 16 = 6 steps
    assert {w["steps"] for w in whole["per_worker"]} == {6} and whole["iterations"] == 6


@pytest.mark.parametrize("bandwidth,exchange,partitions", [("100MB", "all-to-all", 1), ("1MB", "ring", 8)])
def test_auto_takes_all_to_all_where_it_fits_the_link_and_the_ring_where_not(tmp_path, bandwidth, exchange, partitions):
    """4 workers, 16 samples of 1 ms a step: all-to-all needs 3 x 90,408 bytes a step, which
    fits 100 MB/s x 16 ms at p = 1; at 1 MB/s it would need p = 17 > 8, so the ring (2 x 3/4 x
    90,408 bytes / p, p = 9 wanted), link-bound at p = 8."""
    config = small_config(tmp_path, strategy="ako", workers=4, bandwidth=bandwidth, seconds_per_sample=1e-3)
    summary = ako.simulate(config).summary
    assert (summary["exchange"], summary["partitions"]) == (exchange, partitions)
    if exchange == "ring":
        assert summary["partitions_reason"].startswith("link-bound: the link budget asks for p = 9, capped at 8")
        assert summary["partitions_reason"].endswith(f"the ring, as all-to-all would need more than p = {ako_strategy.P_MAX}")


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_partial_steps_keep_the_fast_workers_at_their_own_pace(tmp_path, exchange):
    """4 simulated workers, rank 3 three times slower: once it has been the last for
    STRAGGLER_STEPS steps, it takes partial steps (the default micro-batch, 4 of a step's 16
    samples), the other three run at their own pace and rank 3 keeps up with fewer samples a
    step; with partial steps off (`micro_batch` = the batch) every step takes the straggler's
    time. Virtual time: 16 ms a step, 48 ms for the straggler."""
    config = small_config(
        tmp_path, strategy="ako", workers=4, train_samples=4 * 16 * 12, epochs=3.0, exchange=exchange, partitions=2,
        straggler=("rank=3,factor=3",), seconds_per_sample=1e-3, bandwidth="1GB", latency="0us",
    )  # fmt: skip
    on, off = ako.simulate(config).summary, ako.simulate(replace(config, micro_batch=16)).summary
    steps, slow_steps = on["iterations"], ako_strategy.STRAGGLER_STEPS + 1
    assert off["partial_steps"] == 0 and off["train_seconds"] >= 0.99 * steps * 0.048
    assert on["train_seconds"] < 1.1 * ((steps - slow_steps) * 0.016 + slow_steps * 0.048) < 0.5 * off["train_seconds"]
    fast, slow = on["per_worker"][:3], on["per_worker"][3]
    assert [w["partial_steps"] for w in fast] == [0, 0, 0] and slow["partial_steps"] >= steps - slow_steps - 1
    assert all(w["samples"] == steps * 16 for w in fast) and slow["samples"] <= steps * 16 / 2
    assert [w["samples_short"] for w in on["per_worker"]] == [0, 0, 0, steps * 16 - slow["samples"]]
    assert on["samples_short"] == steps * 16 - slow["samples"] and off["samples_short"] == 0


@pytest.mark.parametrize("exchange,compress", [("all-to-all", "int8"), ("all-to-all", "fp4"), ("ring", "fp4")])
def test_compressed_windows_lose_no_update(tmp_path, exchange, compress):
    """What a window's code leaves out stays in the accumulator (all-to-all) or the mean's
    residual (ring) and goes in the float32 flush: w_end = w_0 - lr/n x every gradient, as
    uncompressed, with a straggler (partial steps)."""
    _check_conservation(ako.simulate, tmp_path, exchange, 7, 1, seconds_per_sample=1e-3, bandwidth="5MB", compress=compress)


def test_compressed_windows_on_real_processes_as_in_the_simulator(tmp_path):
    config = small_config(tmp_path, strategy="ako", exchange="all-to-all", partitions=3, staleness=0, compress="int8", epochs=1.0)
    real = ako.train(config)
    simulated = ako.simulate(replace(config, seconds_per_sample=1e-3, bandwidth="10MB"))
    for a, b in zip(real.workers, simulated.workers, strict=True):
        torch.testing.assert_close(b.params, a.params, rtol=0, atol=1e-5)
    plain = ako.train(replace(config, compress="none"))
    for a, b in zip(real.workers, plain.workers, strict=True):
        assert (a.params - b.params).abs().max() > 1e-6  # the code did change the path


@pytest.mark.parametrize("compress", ["bf16", "int8", "fp4"])
def test_compressed_windows_send_the_codes_bytes(tmp_path, compress):
    """All-to-all, as `test_bytes_per_step_are_n_minus_1_windows_over_p` but each window in the
    code's bytes; the flush stays float32."""
    from ako.strategies.compress import CODECS

    n, p = 3, 4
    config = small_config(tmp_path, strategy="ako", workers=n, exchange="all-to-all", partitions=p, train_samples=3 * 16 * 8,
                          epochs=1.0, compress=compress)  # fmt: skip
    windows = sum(CODECS[compress].nbytes(hi - lo) for lo, hi in partition_bounds(NUMEL, p, _boundaries(tmp_path)))
    for w in ako.simulate(replace(config, seconds_per_sample=1e-3, bandwidth="10MB")).summary["per_worker"]:
        assert w["bytes_sent"] == 2 * (n - 1) * windows + (n - 1) * G + (n - 1)


def _boundaries(tmp_path):
    job = Job(small_config(tmp_path))
    return job.build_replica(job.load_data(), torch.device("cpu")).boundaries


def test_auto_counts_the_codes_bytes(tmp_path):
    """The same link budget asks for fewer partitions when the windows travel as int8."""
    config = small_config(tmp_path, strategy="ako", workers=3, exchange="all-to-all", bandwidth="2MB", seconds_per_sample=1e-3)
    plain = ako.simulate(config).summary["partitions"]
    coded = ako.simulate(replace(config, compress="int8")).summary["partitions"]
    assert coded < plain, (plain, coded)
