"""What every strategy program is given (`WorkerContext`, `ServerContext`) and what describes a
strategy in the registry (`Strategy`, with its `Option`s)."""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from ako.checks import choice
from ako.replica import Replica

# `ako.config.TrainConfig` is typed Any here: config reads this registry, and importing it
# back would make a cycle.
TrainConfig = Any

WorkerProgram = Callable[["WorkerContext"], Generator[Any, Any, dict]]
ServerProgram = Callable[["ServerContext"], Generator[Any, Any, dict]]
ConfigCheck = Callable[[TrainConfig, Replica], None]


@dataclass
class WorkerContext:
    """A worker's view of the run, besides the operations it yields.

    `stopping` turns true when this worker should finish: its epochs are done, the time budget
    is spent, or the evaluator reached the target accuracy. A strategy decides how its workers
    agree on the last step (synchronous ones vote in a collective). `plan_done` is the first
    reason alone, which every worker meets at the same step without a vote.
    """

    rank: int
    world_size: int  # workers (servers not counted)
    replica: Replica
    config: TrainConfig
    should_stop: Callable[[], bool]
    servers: list[int] = field(default_factory=list)  # the parameter servers' ranks, if any
    resumed_step: int = 0  # the step a resumed run starts from (0: a fresh run)
    plan_done: Callable[[], bool] = lambda: False

    @property
    def stopping(self) -> bool:
        return self.should_stop()

    @property
    def peers(self) -> list[int]:
        """Every other worker's rank."""
        return [r for r in range(self.world_size) if r != self.rank]


@dataclass
class ServerContext:
    """A parameter server's view of the run. Server `index` (of `len(servers)`) owns the
    parameters [lo, hi) of the flat vector; `replica` holds the initial parameters (every rank
    builds one). `workers` are the workers' ranks. `restored`: the server's state from a
    checkpoint when the run resumes (its `Shard.state_dict`); `on_update(shard)` is called
    after every update (the runtime saves checkpoints there)."""

    rank: int
    index: int
    servers: list[int]
    workers: list[int]
    replica: Replica
    config: TrainConfig
    restored: dict | None = None
    on_update: Callable[[Any], None] = lambda shard: None


@dataclass(frozen=True, kw_only=True)
class Option:
    """A setting a strategy takes: the `TrainConfig` field `name`, what it means for this
    strategy (`help`, for the CLI and `ako info`), and how it is resolved when the run is
    validated: `choices` (the allowed values), `default` (what None becomes: a value, or a
    function of the config), `check(value, config)` (the value normalised, or ConfigError)."""

    name: str
    help: str
    choices: tuple[str, ...] | None = None
    default: Any = None
    check: Callable[[Any, TrainConfig], Any] | None = None

    def resolve(self, config: TrainConfig) -> Any:
        """This option's value in `config`, defaulted and checked. Raises ConfigError."""
        value = getattr(config, self.name)
        if value is None:
            value = self.default(config) if callable(self.default) else self.default
        if self.choices is not None:
            choice(self.name, value, self.choices)
        return value if self.check is None or value is None else self.check(value, config)


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """A registry entry: a named worker program, and a server program for the parameter-server
    strategies. Each program returns a dict of facts; scalar facts reach the run summary (per
    rank in `per_worker`).

    `replicas_differ`: the workers' replicas are not kept equal, so the records and summary
    also hold their consensus distance and the accuracy of their average (weighted by each
    worker's `average_weight` fact, when its program returns one: push-sum gossip).
    `survives_loss`: the run carries on when a worker other than rank 0 dies; a function of
    the run's config where that depends on its settings (`survives`).
    `lockstep`: every rank runs the same iteration at once (allreduce, bsp, absp), so a
    checkpoint resumes exactly; a rank that gets the call for one too late skips it.
    `options`: the settings only this strategy (and others declaring them) takes.
    `check(config, replica)` raises ConfigError for options the model (the replica's `numel`
    and `model`) cannot take (before any process starts). `summarise(per_rank)` adds strategy-specific totals to the summary.
    `paper`: where the algorithm comes from. `optimizer_on`: where the optimizer (and its
    schedule) runs: "workers" (any torch optimizer) or "servers" (each steps its shard: only
    elementwise optimizers, `ako.optim.check_elementwise`). `averages_own_steps`: the model
    moves by the mean of the workers' own optimizer steps, each on its own batch (gossip,
    easgd, ssp, asp), so `--lr-scaling auto` takes sqrt(n) x lr with an adaptive optimizer
    (`ako.optim.lr_factor`). `stale_steps`: each worker steps its own optimizer on parameters
    that miss its peers' latest updates (ssp, asp; ako unless in lock-step), so an optimizer
    with Adam's betas takes a lower beta1 (`ako.optim.stale_betas`); a function of the run's
    config where that depends on its settings (`steps_stale`)."""

    name: str
    worker: WorkerProgram
    server: ServerProgram | None = None
    replicas_differ: bool = False
    survives_loss: bool | Callable[[Any], bool] = False
    lockstep: bool = False
    options: tuple[Option, ...] = ()
    check: ConfigCheck | None = None
    summarise: Callable[[list[dict]], dict] | None = None
    paper: str = ""
    optimizer_on: str = "workers"
    averages_own_steps: bool = False
    stale_steps: bool | Callable[[Any], bool] = False

    def survives(self, config: TrainConfig) -> bool:
        """Whether a run with `config` carries on when a worker other than rank 0 dies."""
        return self.survives_loss(config) if callable(self.survives_loss) else self.survives_loss

    def steps_stale(self, config: TrainConfig) -> bool:
        """Whether a run with `config` steps the workers' optimizers on stale parameters."""
        return self.stale_steps(config) if callable(self.stale_steps) else self.stale_steps
