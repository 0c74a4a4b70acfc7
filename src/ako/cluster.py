"""The cluster description both runtimes share: who is slow, and by how much.

A straggler is described by text, as the `--straggler` flag takes it:
- `rank=R,factor=K`: worker R is always slow; each of its computations takes K times as long.
- `prob=P,factor=K`: any worker, at any step, is slow with probability P (independent draws,
  seeded by the run seed and the rank), a transient slowdown by factor K.
Several descriptions combine by multiplying their factors. The distributed runtime makes a
computation K times as long by waiting (K - 1) times its measured compute time; the simulated
runtime charges K times the modelled time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


class ClusterError(ValueError):
    """A bad cluster description; the message is one line naming the value."""


@dataclass(frozen=True)
class Straggler:
    """One straggler description: a fixed slow `rank`, or a per-step slowdown `prob`ability;
    `factor` (>= 1) multiplies the compute time."""

    factor: float
    rank: int | None = None
    prob: float | None = None

    def __str__(self) -> str:
        which = f"rank={self.rank}" if self.rank is not None else f"prob={self.prob:g}"
        return f"{which},factor={self.factor:g}"


_FORMAT = "expected rank=R,factor=K or prob=P,factor=K (K >= 1, 0 <= P <= 1)"


def parse_straggler(text: str) -> Straggler:
    """Parse "rank=1,factor=3" or "prob=0.1,factor=2". Raises ClusterError."""
    fields = {}
    for item in str(text).split(","):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in ("rank", "prob", "factor") or key.strip() in fields:
            raise ClusterError(f"straggler {text!r}: {_FORMAT}")
        fields[key.strip()] = value.strip()
    if "factor" not in fields or ("rank" in fields) == ("prob" in fields):
        raise ClusterError(f"straggler {text!r}: {_FORMAT}")
    try:
        factor = float(fields["factor"])
        rank = int(fields["rank"]) if "rank" in fields else None
        prob = float(fields["prob"]) if "prob" in fields else None
    except ValueError:
        raise ClusterError(f"straggler {text!r}: {_FORMAT}") from None
    if not (math.isfinite(factor) and 1 <= factor <= 1000):
        raise ClusterError(f"straggler {text!r}: factor must be a number >= 1 and <= 1000")
    if rank is not None and rank < 0:
        raise ClusterError(f"straggler {text!r}: rank must be >= 0")
    if prob is not None and not 0 <= prob <= 1:
        raise ClusterError(f"straggler {text!r}: prob must be in [0, 1]")
    return Straggler(factor, rank, prob)


class Slowdown:
    """The compute-time factor of one worker, step by step (deterministic given the seed).

    `factor(step)` is the product of the fixed factor (if this rank is a fixed straggler) and,
    for each transient description, K with probability P. Call it once per step, in order.
    """

    def __init__(self, stragglers: list[Straggler], rank: int, seed: int):
        self.fixed = math.prod(s.factor for s in stragglers if s.rank == rank)
        self.transient = [s for s in stragglers if s.prob is not None]
        self.rng = np.random.default_rng([seed, rank, 0x5106])

    def factor(self) -> float:
        """The factor for this worker's next step (>= 1)."""
        slow = self.fixed
        for s in self.transient:
            if self.rng.random() < s.prob:
                slow *= s.factor
        return slow

    @property
    def active(self) -> bool:
        """False when this worker is never slowed (no waiting, no random draws needed)."""
        return self.fixed != 1 or bool(self.transient)


def check_stragglers(texts, workers: int) -> tuple[str, ...]:
    """Validate `--straggler` texts against the worker count; returns them normalised.
    Raises ClusterError."""
    specs = [parse_straggler(t) for t in texts]
    for i, s in enumerate(specs):
        if s.rank is not None and s.rank >= workers:
            raise ClusterError(f"straggler {str(s)!r}: rank must be a worker, in [0, {workers})")
        if s.rank is not None and (first := next((f for f in specs[:i] if f.rank == s.rank), None)):
            raise ClusterError(f"straggler {str(s)!r}: rank {s.rank} has one already ({str(first)!r}); give each rank one")
    return tuple(str(s) for s in specs)
