"""Synchronisation strategies: one module per model, each a worker program (DESIGN.md).

`STRATEGIES` maps a strategy's name to its `Strategy`; `WorkerContext` is what a worker
program sees of its runtime besides the operations it yields.
"""

from ako.strategies import absp, ako, allreduce, bsp, easgd, gossip, paramserver, ssp
from ako.strategies.base import ServerContext, Strategy, WorkerContext


def _server_strategy(name, worker, server, summarise=paramserver.summarise, **kw) -> Strategy:
    return Strategy(name, worker, False, paramserver.check, server, summarise=summarise, **kw)


STRATEGIES: dict[str, Strategy] = {
    "allreduce": Strategy("allreduce", allreduce.worker, decentralised=False),
    "ako": Strategy("ako", ako.worker, decentralised=True, check=ako.check, survives_loss=True),
    "gossip": Strategy("gossip", gossip.worker, decentralised=True, survives_loss=True),
    "bsp": _server_strategy("bsp", paramserver.gradient_worker, bsp.server),
    "ssp": _server_strategy("ssp", paramserver.update_worker, ssp.ssp_server),
    "asp": _server_strategy("asp", paramserver.update_worker, ssp.asp_server, survives_loss=True),
    "absp": _server_strategy("absp", absp.worker, absp.server, summarise=absp.summarise),
    "easgd": Strategy(
        "easgd", easgd.worker, True, paramserver.check, easgd.server, survives_loss=True, summarise=paramserver.summarise
    ),
}

__all__ = ["STRATEGIES", "ServerContext", "Strategy", "WorkerContext"]
