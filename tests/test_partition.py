"""Ako's partitions of the flat gradient, and the auto rule for p."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ako.strategies.partition import auto_partitions, partition_bounds


def test_cuts_move_to_nearby_tensor_boundaries():
    # tensors [0,100) [100,205) [205,300): ideal cuts at 100 and 200; 205 is within 10% of 100
    assert partition_bounds(300, 3, [0, 100, 205, 300]) == [(0, 100), (100, 205), (205, 300)]


def test_cuts_stay_balanced_when_no_boundary_is_near():
    # one big tensor: cut inside it
    assert partition_bounds(1000, 4, [0, 1000]) == [(0, 250), (250, 500), (500, 750), (750, 1000)]


def test_p_out_of_range():
    with pytest.raises(ValueError, match="partitions 11: must be between 1 and the parameter count 10"):
        partition_bounds(10, 11, [0, 10])
    with pytest.raises(ValueError):
        partition_bounds(10, 0, [0, 10])


@given(
    sizes=st.lists(st.integers(1, 500), min_size=1, max_size=12),
    data=st.data(),
)
def test_partitions_cover_contiguously_and_stay_balanced(sizes, data):
    numel = sum(sizes)
    boundaries = [0]
    for s in sizes:
        boundaries.append(boundaries[-1] + s)
    p = data.draw(st.integers(1, numel))
    parts = partition_bounds(numel, p, boundaries)
    assert len(parts) == p
    assert parts[0][0] == 0 and parts[-1][1] == numel
    assert all(a < b for a, b in parts)
    assert all(parts[i][1] == parts[i + 1][0] for i in range(p - 1))
    ideal = numel / p
    if ideal >= 10:  # each cut moves at most 10% of a partition (+1 for rounding)
        assert all(abs((b - a) - ideal) <= 0.2 * ideal + 2 for a, b in parts)


def test_auto_rule():
    mb = 1_000_000
    # (n-1) x 2.5 MB per step against 100 MB/s x 10 ms = 1 MB per step
    assert auto_partitions(1 * 2.5 * mb, 100 * mb, 0.010, 10**6) == 3
    assert auto_partitions(3 * 2.5 * mb, 100 * mb, 0.010, 10**6) == 8  # ceil(7.5)
    assert auto_partitions(0, 100 * mb, 0.010, 10**6) == 1  # a single worker sends nothing
    assert auto_partitions(3 * 1000, 1e12, 1.0, 10**6) == 1  # a fast link: all-to-all
    assert auto_partitions(63 * 10**9, 1.0, 1.0, 5000) == 5000  # never more than the parameters


@given(n=st.integers(2, 128), grad=st.integers(1_000, 10**8), budget=st.floats(1e3, 1e9))
def test_auto_keeps_bytes_per_step_within_the_budget(n, grad, budget):
    need = (n - 1) * grad
    p = auto_partitions(need, budget, 1.0, 10**9)
    assert need / p <= budget * (1 + 1e-9)
    assert p == 1 or need / (p - 1) > budget
