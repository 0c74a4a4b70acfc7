"""The simulation's progress bar: every worker's steps out of the steps planned (the epochs of
every worker), the virtual seconds simulated, their rate in virtual seconds per real second,
rank 0's last logged test accuracy (logged during the run only with a target accuracy, and
for strategies whose replicas differ once every worker's copy is in), and tqdm's estimate of
the real time left.

Counting every worker's steps, not rank 0's, keeps the estimate true where the workers do not
keep together: with asynchronous strategies or a straggler the run ends when the slowest
worker does. A run that stops at a target accuracy or a time budget ends early: the estimate
is then an upper bound.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import simpy
from tqdm import tqdm

from ako.run.worker import BarStream, shown_metric

_REFRESH = 0.25  # real seconds between two updates of the figures after the bar


class Progress:
    """A tqdm bar of `total` worker steps for a simulation on `env`. `shown`: True, False, or
    None (only on a terminal). `last_metrics()` gives rank 0's last evaluation record, or None."""

    def __init__(self, env: simpy.Environment, total: int, shown: bool | None, last_metrics: Callable[[], dict | None]):
        self.env, self.last_metrics = env, last_metrics
        shown = False if sys.stderr is None else shown  # started with stderr closed
        self.bar = tqdm(total=total, unit="step", disable=None if shown is None else not shown, file=BarStream(sys.stderr))
        self.started = self.shown_at = time.perf_counter()

    def step(self) -> None:
        """One worker finished one step. Should a strategy run past the plan, the total grows."""
        if self.bar.n >= self.bar.total:
            self.bar.total = self.bar.n + 1
        self.bar.update()
        now = time.perf_counter()
        if now - self.shown_at >= _REFRESH and not self.bar.disable:
            self.shown_at = now
            self.bar.set_postfix(self.figures(now - self.started), refresh=False)

    def figures(self, real: float) -> dict:
        """What the bar shows after the count: virtual seconds, virtual seconds per real
        second, and rank 0's last logged test accuracy (a language model's loss, or the first metric), with its epoch."""
        shown = {"virtual": f"{self.env.now:.3g} s", "virtual/real": f"{self.env.now / max(real, 1e-9):.3g}"}
        record = self.last_metrics() or {}
        tested = {k.removeprefix("test_"): v for k, v in record.items() if k.startswith("test_")}
        metric = "test_" + shown_metric(tested) if tested else None
        if metric is not None:
            shown[metric.removeprefix("test_")[:8]] = f"{record[metric]:.4f} at epoch {record.get('epoch', 0):.2f}"
        return shown

    def close(self) -> None:
        """The final figures, and the bar ends."""
        if not self.bar.disable:
            self.bar.set_postfix(self.figures(time.perf_counter() - self.started), refresh=False)
        self.bar.close()
