"""What every strategy program is given and what describes a strategy."""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from ako.config import TrainConfig
from ako.replica import Replica

WorkerProgram = Callable[["WorkerContext"], Generator[Any, Any, dict]]
ConfigCheck = Callable[[TrainConfig, int], None]


@dataclass
class WorkerContext:
    """A worker's view of the run, besides the operations it yields.

    `stopping` turns true when this worker should finish: its epochs are done, the time budget
    is spent, or the evaluator reached the target accuracy. A strategy decides how its workers
    agree on the last step (synchronous ones vote in a collective).
    """

    rank: int
    world_size: int
    replica: Replica
    config: TrainConfig
    should_stop: Callable[[], bool]

    @property
    def stopping(self) -> bool:
        return self.should_stop()

    @property
    def peers(self) -> list[int]:
        """Every other worker's rank."""
        return [r for r in range(self.world_size) if r != self.rank]


@dataclass(frozen=True)
class Strategy:
    """A named worker program. The program returns a dict of facts for the run summary.
    `decentralised`: replicas may differ, so the summary also evaluates their average.
    `check(config, numel)` raises ConfigError for options the model cannot take (before any
    process starts)."""

    name: str
    worker: WorkerProgram
    decentralised: bool
    check: ConfigCheck | None = None
