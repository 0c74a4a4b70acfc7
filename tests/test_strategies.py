"""Equivalences and conservation of the strategies on the real distributed runtime."""

from __future__ import annotations

import pytest
import torch

import ako
from helpers import RECORDED_AKO, single_process_sgd, small_config


def params_of(result):
    return [w.params for w in result.workers]


def test_allreduce_equals_single_process_sgd_on_the_union(tmp_path):
    config = small_config(tmp_path, strategy="allreduce")
    result = ako.train(config)
    steps = result.summary["per_worker"][0]["steps"]
    assert steps == 6
    expected = single_process_sgd(config, steps)
    for params in params_of(result):
        torch.testing.assert_close(params, expected, rtol=0, atol=1e-5)


def test_ako_one_partition_lock_step_equals_allreduce(tmp_path):
    reference = ako.train(small_config(tmp_path, strategy="allreduce"))
    result = ako.train(small_config(tmp_path, strategy="ako", partitions=1, staleness=0))
    assert result.summary["partitions"] == 1
    for params in params_of(result):
        torch.testing.assert_close(params, reference.workers[0].params, rtol=0, atol=1e-5)


@pytest.mark.parametrize("partitions,staleness", [(5, None), (3, 2)])
def test_ako_loses_no_gradient(tmp_path, partitions, staleness):
    """Plain SGD (no momentum, no decay): w_end = w_0 - lr/n * (sum of every gradient of every
    worker) on every replica, once the final flush is in, whatever the arrival order."""
    lr, n = 0.05, 2
    config = small_config(
        tmp_path, strategy="ako", partitions=partitions, staleness=staleness,
        momentum=0.0, weight_decay=0.0, lr=lr, epochs=1.0,
    )  # fmt: skip
    start = single_process_sgd(config, 0)
    result = ako.train(config, strategy=RECORDED_AKO)
    total = sum(w.facts["grad_sum"] for w in result.workers)
    assert total.abs().sum() > 0
    for w in result.workers:
        applied = (start.double() - w.params.double()) * n / lr
        torch.testing.assert_close(applied, total, rtol=0, atol=2e-4)


def test_ako_bytes_per_step_are_n_minus_1_gradients_over_p(tmp_path):
    """Each step sends partition (t mod p) to the n-1 peers; with t a multiple of p that is
    (n-1) x gradient bytes / p per step, plus the final flush of what is left (at most one
    gradient per peer)."""
    n, p = 3, 4
    config = small_config(tmp_path, strategy="ako", workers=n, partitions=p, train_samples=3 * 16 * 8, epochs=1.0)
    result = ako.train(config)
    grad_bytes = 22_602 * 4  # the cnn on 8x8 digits
    for w in result.summary["per_worker"]:
        assert w["steps"] == 8
        flush = (n - 1) * grad_bytes  # a flush sends the whole accumulator
        assert w["bytes_sent"] == 8 * (n - 1) * grad_bytes // p + flush
        assert w["bytes_received"] == w["bytes_sent"]
