"""Synchronisation strategies: one module per model, each a worker program (and a server
program for the parameter-server family, `ps/`), written against the operations of `ops`
(docs/design.md).

`STRATEGIES` is the registry: a strategy's name to its `Strategy` entry, which declares its
programs and its options; config, the CLI and `ako info` read it.
"""

from ako.strategies import ako, allreduce, diloco, gossip
from ako.strategies.base import Option, ServerContext, Strategy, WorkerContext
from ako.strategies.ps import absp, bsp, easgd, ssp

STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (ako.STRATEGY, allreduce.STRATEGY, diloco.DILOCO, diloco.STREAMING, gossip.STRATEGY, bsp.STRATEGY, ssp.SSP, ssp.ASP, absp.STRATEGY, easgd.STRATEGY)
}

__all__ = ["STRATEGIES", "Option", "ServerContext", "Strategy", "WorkerContext"]
