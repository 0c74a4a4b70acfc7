"""Equivalences of the strategies on the real distributed runtime (Ako's: tests/test_ako.py)."""

from __future__ import annotations

import torch

import ako
from helpers import single_process_sgd, small_config


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
