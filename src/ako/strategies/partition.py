"""Splitting the flat gradient into Ako's p partitions, and choosing p (Ako, SoCC 2016, sec. 3)."""

from __future__ import annotations

import bisect
import math


def partition_bounds(numel: int, p: int, boundaries: list[int]) -> list[tuple[int, int]]:
    """Split [0, numel) into p contiguous, non-empty partitions balanced by size.

    Cut k goes at round(k * numel / p), moved to the nearest tensor boundary (from
    `boundaries`, the offsets where parameter tensors start) when one lies within 10% of the
    ideal partition size, so partitions hold whole tensors where that costs little balance.
    Returns p (start, end) pairs. Raises ValueError unless 1 <= p <= numel.
    """
    if not 1 <= p <= numel:
        raise ValueError(f"partitions {p}: must be between 1 and the parameter count {numel}")
    ideal = numel / p
    cuts = [0]
    for k in range(1, p):
        target = round(k * ideal)
        i = bisect.bisect_left(boundaries, target)
        near = min(boundaries[max(i - 1, 0) : i + 1], key=lambda b: abs(b - target))
        cut = near if abs(near - target) <= 0.1 * ideal else target
        # keep every partition non-empty, whatever the snapping did
        cut = min(max(cut, cuts[-1] + 1), numel - (p - k))
        cuts.append(cut)
    cuts.append(numel)
    return list(zip(cuts[:-1], cuts[1:]))


def auto_partitions(bytes_per_step: float, bandwidth: float, step_time: float, numel: int) -> int:
    """Ako's rule for p: the smallest p whose traffic fits the link budget,
    p = ceil(bytes_per_step / (B * T_step)), clipped to [1, numel].

    `bytes_per_step` is what one worker would send per step with p = 1 ((n - 1) x gradient
    bytes all-to-all); with p partitions it sends 1/p of it, which at B bytes/s and T_step
    seconds per step must be <= B * T_step. All-to-all traffic grows with n, and so does p,
    so bytes per worker per second stay constant as the cluster grows.
    """
    budget = bandwidth * step_time
    if not budget > 0:  # a step that takes no time: nothing fits
        return numel
    return min(max(1, math.ceil(min(bytes_per_step / budget, numel))), numel)
