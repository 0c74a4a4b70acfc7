"""Synchronisation strategies: one module per model, each a worker program (DESIGN.md).

`STRATEGIES` maps a strategy's name to its `Strategy`; `WorkerContext` is what a worker
program sees of its runtime besides the operations it yields.
"""

from ako.strategies import ako, allreduce, gossip
from ako.strategies.base import ServerContext, Strategy, WorkerContext

STRATEGIES: dict[str, Strategy] = {
    "allreduce": Strategy("allreduce", allreduce.worker, decentralised=False),
    "ako": Strategy("ako", ako.worker, decentralised=True, check=ako.check),
    "gossip": Strategy("gossip", gossip.worker, decentralised=True, survives_loss=True),
}

__all__ = ["STRATEGIES", "ServerContext", "Strategy", "WorkerContext"]
