"""The outer optimizer that DiLoCo (Douillard et al., arXiv 2311.08105) and Ako's outer step
share: SGD with Nesterov momentum on a flat vector, one fragment (a list of [lo, hi) ranges) at
a time, and the gather/scatter of a fragment's values."""

from __future__ import annotations

import torch


def gather(vector: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The fragment's values of `vector` (numel,), concatenated (a copy)."""
    return torch.cat([vector[lo:hi] for lo, hi in ranges])


def scatter(vector: torch.Tensor, ranges: list[tuple[int, int]], values: torch.Tensor) -> None:
    """Write `values` (the fragment's size,) into `vector` at the fragment's ranges."""
    at = 0
    for lo, hi in ranges:
        vector[lo:hi] = values[at : at + hi - lo]
        at += hi - lo


class Nesterov:
    """SGD with Nesterov momentum's update, fragment by fragment, for a flat vector of `numel`
    values: `direction` gives what a step subtracts (torch.optim.SGD's, nesterov=True, without
    weight decay or dampening; plain SGD at momentum 0)."""

    def __init__(self, numel: int, lr: float, momentum: float, device=None):
        self.lr, self.momentum = lr, momentum
        self.buf = torch.zeros(numel, device=device) if momentum else None

    def direction(self, ranges: list[tuple[int, int]], grad: torch.Tensor) -> torch.Tensor:
        """lr (grad + mu b) after b <- mu b + grad on the fragment at `ranges` (its size,;
        `grad` is not modified). Linear in `grad`: a mean delta may go in for a gradient, and
        what comes out is then the step to add (Ako's outer step, strategies/ako.py)."""
        if self.buf is not None:
            buf = gather(self.buf, ranges).mul_(self.momentum).add_(grad)
            scatter(self.buf, ranges, buf)
            grad = grad.add(buf, alpha=self.momentum)
        return grad.mul(self.lr)
