"""The parameter-server strategies on the real distributed runtime: equivalences, A-BSP's
partial processing, SSP's bound, EASGD's elastic term."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch

import ako
from ako.data import ShardSampler, fetch, load_dataset
from ako.models import build_model
from ako.runtime.distributed import checkpoint
from ako.strategies import STRATEGIES, tags
from ako.strategies.ops import Compute, ComputePartial, Recv, Send
from ako.strategies.ps.ssp import WARMUP_CLOCKS
from helpers import make_replica, recorded, single_process_sgd, small_config


def final_params(result):
    return [w.params for w in result.workers]


@pytest.fixture(scope="module")
def bsp_reference(tmp_path_factory):
    return ako.train(small_config(tmp_path_factory.mktemp("bsp"), strategy="bsp"))


def test_bsp_equals_allreduce(tmp_path, bsp_reference):
    allreduce = ako.train(small_config(tmp_path, strategy="allreduce"))
    assert bsp_reference.summary["iterations"] == 6
    assert bsp_reference.summary["staleness_max"] == 0
    for params in final_params(bsp_reference):
        torch.testing.assert_close(params, allreduce.workers[0].params, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(strategy="absp", micro_batch=16),  # no straggler, whole assignments
        dict(strategy="bsp", servers=2),
    ],
    ids=["absp", "bsp-2-servers"],
)
def test_equals_bsp(tmp_path, bsp_reference, overrides):
    result = ako.train(small_config(tmp_path, **overrides))
    for params in final_params(result):
        torch.testing.assert_close(params, bsp_reference.workers[0].params, rtol=0, atol=1e-5)


def test_ssp_with_bound_zero_equals_bsp_with_momentum(tmp_path, bsp_reference):
    """Momentum 0.9, Nesterov and weight decay on the workers (each pushes its own optimizer
    step), the server adding the deltas / n: with s = 0 every push of a clock was computed on
    the same parameters, so SSP equals BSP's server-side momentum step on the mean."""
    ssp = ako.train(small_config(tmp_path, strategy="ssp", staleness=0, servers=2))
    assert ssp.summary["staleness_max"] == 1  # the other worker's push of the same clock
    for params in final_params(ssp):
        torch.testing.assert_close(params, bsp_reference.workers[0].params, rtol=0, atol=1e-5)


def test_asp_with_one_worker_equals_single_process_sgd_with_momentum(tmp_path):
    config = small_config(tmp_path, strategy="asp", workers=1, servers=2)
    result = ako.train(config)
    steps = result.summary["iterations"]
    assert steps == 12 and result.summary["staleness_max"] == 0
    torch.testing.assert_close(result.workers[0].params, single_process_sgd(config, steps), rtol=0, atol=1e-5)


def _record_absp(op, result, log):
    if isinstance(op, ComputePartial):
        log.setdefault("assignments", []).append(result.indices.clone())
        log.setdefault("processed", []).append(result.samples)
        log.setdefault("sums", []).append(result.grad_sum.clone())
    elif isinstance(op, Recv) and op.tag == tags.PS_REPLY:
        log.setdefault("pulled", []).append(result.tensor.clone())


RECORDED_ABSP = dataclasses.replace(STRATEGIES["absp"], worker=recorded(STRATEGIES["absp"].worker, _record_absp))


def test_absp_uses_skipped_samples_within_two_iterations_and_applies_sum_over_count(tmp_path):
    lr = 0.05
    config = small_config(
        tmp_path, strategy="absp", batch_size=48, micro_batch=16, epochs=2.0, straggler=("rank=1,factor=4",),
        lr=lr, momentum=0.0, weight_decay=0.0,
    )  # fmt: skip
    result = ako.train(config, strategy=RECORDED_ABSP)
    logs = [w.facts for w in result.workers]
    iterations = len(logs[0]["processed"])
    assert iterations == result.summary["iterations"] == 8
    straggler = logs[1]
    assert min(straggler["processed"]) < 48, "the straggler was never cut short"
    assert result.summary["handed_in"] < 1.0
    # the samples left waiting go first next time, in order, and the fresh ones continue the
    # straggler's sample stream: none lost, none repeated
    waiting, fresh = [], []
    for assigned, done in zip(straggler["assignments"], straggler["processed"]):
        assigned = assigned.tolist()
        assert assigned[: len(waiting)] == waiting
        fresh += assigned[len(waiting) :]
        waiting = assigned[done:]
    sampler = ShardSampler(config.train_samples, 1, 2, config.batch_size, config.seed)
    assert fresh == sampler.stream(0, len(fresh)).tolist()
    # everything skipped at t is processed within the next two iterations (first in, first out)
    done = straggler["processed"]
    for t in range(iterations - 2):
        skipped = len(straggler["assignments"][t]) - done[t]
        assert skipped <= done[t + 1] + done[t + 2], f"iteration {t}: {skipped} skipped, then {done[t + 1]}, {done[t + 2]}"
    # each update is sum / count of what was handed in (plain SGD: w' = w - lr * sum / count)
    before = single_process_sgd(config, steps=0).double()  # the initial parameters
    for t in range(iterations):
        total = sum(log["sums"][t].double() for log in logs)
        count = sum(log["processed"][t] for log in logs)
        after = logs[0]["pulled"][t].double()
        torch.testing.assert_close(after, before - lr * total / count, rtol=0, atol=1e-5)
        before = after


def _record_clocks(op, log):
    """Before the operation: a clock's start, and a push's send (after it, a busy machine could
    run the peers' next clocks before this worker took the time: a test that failed under load)."""
    if isinstance(op, Compute):
        log.setdefault("starts", []).append(time.monotonic())
    elif isinstance(op, Send) and op.tag == tags.PS_PUSH:
        pushes = log.setdefault("pushes", [])
        if len(pushes) == op.step:  # the first server's push of this clock
            pushes.append(time.monotonic())


def _nothing(op, result, log):
    pass


RECORDED_SSP = dataclasses.replace(STRATEGIES["ssp"], worker=recorded(STRATEGIES["ssp"].worker, _nothing, before=_record_clocks))


@pytest.mark.parametrize("staleness", [2])
def test_ssp_no_worker_runs_more_than_s_clocks_ahead(tmp_path, staleness):
    config = small_config(tmp_path, strategy="ssp", staleness=staleness, epochs=3.0, straggler=("rank=1,factor=4",))
    result = ako.train(config, strategy=RECORDED_SSP)
    logs = [w.facts for w in result.workers]
    ahead = 0
    for w, log in enumerate(logs):
        for c, start in enumerate(log["starts"]):
            for v, other in enumerate(logs):
                done = sum(1 for t in other["pushes"] if t <= start)
                if v != w:
                    assert done >= c - staleness, f"worker {w} started clock {c} while worker {v} had pushed {done}"
                    ahead = max(ahead, c - done)
    assert ahead == staleness, "the straggler never made the bound bite"
    for w, log in enumerate(logs):  # the warm-up: lock-step for the first clocks
        for c, start in enumerate(log["starts"][:WARMUP_CLOCKS]):
            assert all(sum(1 for t in other["pushes"] if t <= start) >= c for other in logs)
    # a read includes every update of clocks < c - s; the other worker's clocks c - s .. c + s may be missing
    assert 1 <= result.summary["staleness_max"] <= (2 - 1) * (2 * staleness + 1)


def test_easgd_with_alpha_zero_is_local_sgd(tmp_path):
    config = small_config(tmp_path, strategy="easgd", beta=0.0, tau=2)
    result = ako.train(config)
    assert result.summary["centre_accuracy"] is not None
    for rank, worker in enumerate(result.workers):
        expected = single_process_sgd(config, 6, ranks=[rank])
        torch.testing.assert_close(worker.params, expected, rtol=0, atol=1e-5)


def test_easgd_elastic_updates_match_the_paper_on_one_worker(tmp_path):
    """One worker (so the order of exchanges is fixed), two servers: after each local SGD step,
    d = alpha (w - x); x += d; w -= d, with alpha = beta / n (Zhang et al. 2015, Algorithm 1)."""
    config = small_config(tmp_path, strategy="easgd", workers=1, servers=2, beta=0.5, tau=2, epochs=0.25)
    result = ako.train(config)
    split = load_dataset(config.dataset, config.data_dir, config.train_samples, config.test_samples)
    torch.manual_seed(config.seed)
    replica = make_replica(build_model(config.model, split.input_shape, split.num_classes), config)
    centre = replica.params.clone()
    sampler = ShardSampler(len(split.train), 0, 1, config.batch_size, config.seed)
    steps = result.summary["iterations"]
    assert steps == 6
    for t in range(1, steps + 1):
        replica.compute_gradient([fetch(split.train, sampler.batch(t - 1))])
        replica.step(replica.grad.clone())
        if t % config.tau == 0 or t == steps:
            d = config.beta * (replica.params - centre)
            centre += d
            replica.params.sub_(d)
    torch.testing.assert_close(result.workers[0].params, replica.params, rtol=0, atol=1e-5)
    torch.testing.assert_close(result.workers[0].facts["centre"], centre, rtol=0, atol=1e-5)


@pytest.mark.parametrize("strategy", ["ssp", "asp"])
def test_a_resume_continues_from_the_workers_momentum(tmp_path, strategy):
    """ssp and asp keep the optimizer state on the workers: a checkpoint holds each worker's
    momentum buffer, and a run resumed from it ends where the uninterrupted run ended (one
    worker: the order of pushes is fixed, so the two runs are the same computation)."""
    config = small_config(tmp_path, strategy=strategy, workers=1, train_samples=None, epochs=3.0, checkpoint_every="0.2s")
    whole = ako.train(config)
    run_dir = whole.summary["run_dir"]
    point = checkpoint.latest(run_dir, 2)
    assert point is not None and 0 < point < whole.summary["iterations"]
    saved = checkpoint.load(run_dir, point, 0)["optimizer"]["optimizer"]["state"][0]["momentum_buffer"]
    assert saved is not None and saved.abs().sum() > 0
    (Path(run_dir) / "summary.json").unlink()  # as if the run had been killed after that checkpoint
    resumed = ako.train(dataclasses.replace(config, resume=run_dir))
    assert resumed.summary["resumed_from_step"] == point
    torch.testing.assert_close(resumed.workers[0].params, whole.workers[0].params, rtol=0, atol=1e-6)


def test_only_pushes_staler_than_a_round_are_damped():
    """min(1, n / (staleness + 1)): n = 8 workers taking turns push with staleness up to 7 at
    full weight; a straggler's push 31 updates old counts a quarter."""
    from ako.strategies.ps.ssp import staleness_scale

    assert [staleness_scale(8, s) for s in (0, 7, 15, 31)] == [1.0, 1.0, 0.5, 0.25]
    assert staleness_scale(1, 0) == 1.0


def test_the_stale_strategies_equal_their_references_in_the_simulator(tmp_path, bsp_reference):
    """The same programs on virtual time: ssp with s = 0 equals bsp with momentum, and asp on
    one worker equals single-process SGD with momentum."""
    ssp = ako.simulate(small_config(tmp_path, strategy="ssp", staleness=0, servers=2, seconds_per_sample=1e-3, bandwidth="10MB"))
    for params in final_params(ssp):
        torch.testing.assert_close(params, bsp_reference.workers[0].params, rtol=0, atol=1e-5)
    config = small_config(tmp_path, strategy="asp", workers=1, seconds_per_sample=1e-3)
    asp = ako.simulate(config)
    expected = single_process_sgd(config, asp.summary["iterations"])
    torch.testing.assert_close(asp.workers[0].params, expected, rtol=0, atol=1e-5)


def test_easgd_tau_auto_fits_a_round_into_the_servers_links(tmp_path):
    """tau = ceil(n x model bytes / (S x B x T_step)): 4 workers, 90,408-byte model, 2 servers,
    1 MB/s links, 16 samples of 1 ms a step: ceil(361,632 / 32,000) = 12; the summary says why."""
    config = small_config(tmp_path, strategy="easgd", workers=4, servers=2, bandwidth="1MB", seconds_per_sample=1e-3)
    summary = ako.simulate(config).summary
    assert summary["tau"] == 12 and summary["tau_reason"].startswith("auto: n x model / servers = 0.18 MB")
    given = ako.simulate(dataclasses.replace(config, tau=3)).summary
    assert given["tau"] == 3 and given["tau_reason"] == "set by --tau"
