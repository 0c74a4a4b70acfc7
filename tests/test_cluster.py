"""The cluster description: straggler parsing and the per-step slowdown factors."""

from __future__ import annotations

import pytest

from ako.cluster import ClusterError, Slowdown, check_stragglers, parse_straggler


def test_parse_and_print_round_trip():
    assert str(parse_straggler(" rank = 2 , factor = 3 ")) == "rank=2,factor=3"
    assert str(parse_straggler("prob=0.25,factor=1.5")) == "prob=0.25,factor=1.5"
    assert check_stragglers(["factor=4,rank=0"], workers=1) == ("rank=0,factor=4",)


@pytest.mark.parametrize("text", ["", "rank=1", "factor=2", "rank=1,rank=2,factor=2", "speed=2,rank=1", "rank=1;factor=2"])
def test_malformed(text):
    with pytest.raises(ClusterError, match="expected rank=R,factor=K or prob=P,factor=K"):
        parse_straggler(text)


def test_fixed_straggler_slows_only_its_rank():
    stragglers = [parse_straggler("rank=1,factor=3"), parse_straggler("rank=1,factor=2")]
    assert [Slowdown(stragglers, r, seed=0).factor() for r in range(3)] == [1.0, 6.0, 1.0]
    assert not Slowdown(stragglers, 0, seed=0).active


def test_transient_slowdowns_are_seeded_and_have_the_given_rate():
    stragglers = [parse_straggler("prob=0.2,factor=5")]
    a = [Slowdown(stragglers, 1, seed=7).factor() for _ in range(1)]
    first, second = Slowdown(stragglers, 1, seed=7), Slowdown(stragglers, 1, seed=7)
    run = [first.factor() for _ in range(5000)]
    assert run == [second.factor() for _ in range(5000)]
    assert set(run) == {1.0, 5.0} and a[0] == run[0]
    assert abs(run.count(5.0) / 5000 - 0.2) < 0.02
    other = Slowdown(stragglers, 2, seed=7)
    assert [other.factor() for _ in range(5000)] != run  # each rank draws its own
