"""ako in your own training loop: three lines on a script that trains one model.

    import ako
    model, optimizer, loader = ako.wrap(model, optimizer, loader, strategy="ako")
    ...  # your loop, unchanged: forward, loss.backward(), optimizer.step(), zero_grad()
    model = ako.finish(model)

Start it with `torchrun --nproc-per-node N script.py` or `ako run --workers N script.py ARGS`
(docs/training.md, "Your own training loop"). `wrap` makes the model's parameters and gradients
views of one flat vector each (as ako's `Replica` does), broadcasts rank 0's parameters and
buffers, and starts the strategy's worker program (`ako.runtime.loop.LoopDriver`, the same
program `ako train` runs); `optimizer.step()` then drives it: the gradient in `.grad` answers
the program's compute point, and the program takes the optimizer step (your optimizer's own
`step`) and its exchange. `finish` runs the program's end (Ako's flush, gossip's handshake,
EASGD's last push), writes the run directory's summary, and returns the model: on rank 0 the
run's model (the replicas' average where they differ, EASGD's centre), elsewhere the worker's
own replica.

Every wait has the run's timeout; a failure in `step` or `finish` (a dead peer the strategy
cannot do without, a timeout) ends the process with one line naming the rank (under `ako run`,
the launcher prints it). Bad usage is one line and exit status 2, before anything is written.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import sys
import time
import types
from contextlib import contextmanager
from dataclasses import fields, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ako.checks import ConfigError
from ako.cluster import Slowdown, parse_straggler
from ako.config import TrainConfig, to_toml, validate
from ako.data.sampler import ShardBatches
from ako.metrics import create_run_dir, plan_lines, strategy_facts, write_atomic
from ako.replica import Replica
from ako.run.consensus import consensus_distance
from ako.runtime.distributed import liveness, quiet
from ako.runtime.distributed.launcher import EXPECTED_FAILURES, one_line
from ako.runtime.distributed.mailbox import Dropped, comm_error
from ako.runtime.distributed.process import RUN_DIR_KEY, join_process_group, startup_timeout
from ako.runtime.distributed.replicas import MailboxReplicas
from ako.runtime.distributed.runtime import DistributedRuntime
from ako.runtime.distributed.scripts import FAILED_KEY, LAUNCHER_ENV, SETTINGS_ENV, SURVIVES_KEY
from ako.runtime.loop import LoopDriver, UserOptimization
from ako.strategies import STRATEGIES, ServerContext, WorkerContext
from ako.strategies.ako import default_form

NEEDS_THE_BATCH = {  # strategies a loop cannot run, and why
    "absp": "its partial steps need ako to own the batch (ako train --strategy absp)",
    "bsp": "its servers step the optimizer, and yours lives in your script (ako train --strategy bsp)",
}
EXIT_BAD_USAGE = 2
DEFAULT_RECORD_EVERY = 50  # steps between two records of the synchronisation metrics
_LOOP_SETTINGS = ("out_dir", "record_every")  # wrap's own settings (not TrainConfig fields)


class UsageError(ConfigError):
    """Bad usage of `wrap` (one line): the caller exits with status 2."""


def wrap(model: nn.Module, optimizer: torch.optim.Optimizer, *loaders, strategy: str | None = None, **settings):
    """Train `model` with `optimizer` under `strategy` in the calling script's own loop; returns
    (model, optimizer, *loaders): the same module and optimizer (their `step`, `zero_grad` and a
    DDP-like `model.no_sync()` now ako's), and each of `loaders` (DataLoaders or data sets)
    as this worker's shard (`shard`).

    strategy: ako (default), allreduce, gossip, easgd, ssp or asp (the last three need
        servers: `ako run --servers S`, or servers=S and S more processes under torchrun).
    settings: the strategy's options as `ako train` takes them (partitions=2, staleness=0,
        tau=4, gossip="push-sum", ...), timeout (seconds), seed (of the shards), straggler
        (("rank=1,factor=3",)), bandwidth, servers; out_dir: a run directory for the
        synchronisation metrics is made there (`ako run` sets it: runs); record_every: steps
        between its records (default 50). `ako run`'s flags override these.

    The model's trainable parameters must be exactly the optimizer's, and the optimizer must
    not have stepped yet. On a server rank (easgd, ssp, asp) `wrap` runs the server until the
    workers finish and ends the process. Bad usage: one line on stderr (rank 0) and SystemExit(2).
    """
    try:
        return _wrap(model, optimizer, loaders, strategy, settings)
    except ConfigError as e:
        _usage(str(e))


def finish(model_or_optimizer) -> nn.Module:
    """End the strategy's program after the last step of the loop (Ako's flush, gossip's
    handshake, EASGD's last push), write the run's summary (rank 0, where there is a run
    directory) and return the model to save: rank 0's is the run's model (the replicas' average
    where they differ, EASGD's centre), another rank's its own replica. The optimizer's `step`
    is its own again afterwards."""
    return _loop_of(model_or_optimizer).finish()


def state_dict(model_or_optimizer) -> dict:
    """The synchronisation state to keep in a checkpoint beside the model's and optimizer's:
    the strategy, the number of workers and the steps taken. Load a checkpoint after `wrap`
    (`model.load_state_dict` and `optimizer.load_state_dict` fill the flat vectors in place;
    loaded before, the optimizer would count as stepped), then `load_state_dict` this. What a
    strategy holds in flight (Ako's windows not yet sent, gossip's pushes) is not saved: the
    run goes on from the checkpoint's parameters, as `ako train --resume` does."""
    loop = _loop_of(model_or_optimizer)
    return {"strategy": loop.config.strategy, "workers": loop.config.workers, "steps": loop.driver.steps}


def load_state_dict(model_or_optimizer, state: dict) -> None:
    """Continue from `state_dict`'s dict: the step count goes on from it. Bad usage (another
    strategy or number of workers than the checkpoint's): one line, SystemExit(2)."""
    loop = _loop_of(model_or_optimizer)
    for key in ("strategy", "workers"):
        if state.get(key) != getattr(loop.config, key):
            _usage(f"load_state_dict: the checkpoint's {key} is {state.get(key)!r}, this run's {getattr(loop.config, key)!r}")
    loop.driver.steps = int(state["steps"])


def shard(data, batch_size: int | None = None, seed: int = 0) -> DataLoader:
    """This worker's shard of `data` (a DataLoader or a map-style data set) as a DataLoader:
    disjoint equal shards per worker, reshuffled every epoch (each pass over the loader is the
    next epoch), the batches `ako train` gives this worker with the same seed. A DataLoader's
    batch size, collate function, num_workers and pin_memory are kept (`batch_size`: for a data
    set; default 64). Rank and world from the launcher's environment (RANK, WORLD_SIZE, less
    the servers). Raises UsageError without one, or when a shard is smaller than a batch."""
    rank, workers = _worker_place()
    if rank >= workers:  # a parameter server's: it trains on nothing
        return data
    loader = data if isinstance(data, DataLoader) else None
    dataset = loader.dataset if loader is not None else data
    if not isinstance(dataset, Dataset) or not hasattr(dataset, "__len__"):
        raise UsageError(f"shard: {type(data).__name__} is neither a DataLoader nor a map-style data set")
    if batch_size is None:
        batch_size = (loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)) if loader is not None else 64
    try:
        batches = ShardBatches(len(dataset), rank, workers, batch_size, seed)
    except ValueError as e:
        raise UsageError(f"shard: {e}") from None
    if loader is None:
        return DataLoader(dataset, batch_sampler=batches)
    return DataLoader(dataset, batch_sampler=batches, collate_fn=loader.collate_fn, num_workers=loader.num_workers,
                      pin_memory=loader.pin_memory, worker_init_fn=loader.worker_init_fn)  # fmt: skip


def _usage(line: str):
    if os.environ.get("LOCAL_RANK", "0") == "0":  # once per machine, not once per worker
        print(f"ako: error: {line}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_BAD_USAGE)


def _environment_world() -> tuple[int, int]:
    """(rank, world size) of this process, from torch.distributed or the launcher's environment."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None or world is None:
        raise UsageError("no launcher environment: rank and world size unknown (RANK and WORLD_SIZE are not set); "
                         "start the script with torchrun --nproc-per-node N or ako run --workers N")  # fmt: skip
    if not (rank.isdigit() and world.isdigit() and 0 <= int(rank) < int(world)):
        raise UsageError(f"RANK={rank!r}, WORLD_SIZE={world!r}: must be integers with 0 <= RANK < WORLD_SIZE")
    return int(rank), int(world)


def _worker_place() -> tuple[int, int]:
    """(rank, number of workers): the world less the servers (`ako run --servers`)."""
    rank, world = _environment_world()
    servers = _given_settings({}).get("servers") or 0
    return rank, max(1, world - int(servers))


def _given_settings(settings: dict) -> dict:
    """`settings` with `ako run`'s (SETTINGS_ENV) over them."""
    text = os.environ.get(SETTINGS_ENV)
    if not text:
        return dict(settings)
    try:
        return {**settings, **json.loads(text)}
    except ValueError:
        raise UsageError(f"{SETTINGS_ENV}={text[:80]!r}: not JSON settings") from None


def _config(strategy: str | None, settings: dict, world: int, optimizer) -> tuple[TrainConfig, dict]:
    """The run's TrainConfig (validated) and the loop's own settings. Raises UsageError."""
    given = _given_settings({**({"strategy": strategy} if strategy is not None else {}), **settings})
    own = {k: given.pop(k) for k in _LOOP_SETTINGS if k in given}
    known = {f.name for f in fields(TrainConfig)}
    if unknown := sorted(set(given) - known):
        raise UsageError(f"setting {unknown[0]!r}: not a setting of ako (see ako train --help)")
    name = given.get("strategy", "ako")
    if name in NEEDS_THE_BATCH:
        raise UsageError(f"strategy {name} cannot run in your own loop: {NEEDS_THE_BATCH[name]}")
    server_side = name in STRATEGIES and STRATEGIES[name].server is not None
    if server_side and given.get("servers") is None:
        raise UsageError(f"strategy {name} needs parameter servers, and none were started: run the script with "
                         "ako run --servers S (or give servers=S to wrap and start S more processes)")  # fmt: skip
    servers = int(given.get("servers") or 0) if server_side else 0
    if name == "ako":
        # as ako.form takes it, but with the loop's optimizer (the config's is ako train's default)
        adaptive = type(optimizer) is not torch.optim.SGD
        update, (lr, momentum) = default_form(adaptive, given.get("exchange", "auto"), world, given.get("update", "auto"),
                                              given.get("outer_lr"), given.get("outer_momentum"))  # fmt: skip
        given.update(update=update, outer_lr=lr, outer_momentum=momentum)
    config = replace(TrainConfig(**given), workers=max(1, world - servers), model="custom", dataset="custom", progress=False)
    try:
        config = validate(config)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    if world - servers < 1:
        raise UsageError(f"servers {servers}: the world size {world} leaves no workers")
    if name == "ako":  # partial steps need ako to own the batch: a micro-batch of the whole step turns them off
        config = replace(config, micro_batch=config.step_samples)
    return config, own


def _check_pair(model: nn.Module, optimizer) -> list[torch.Tensor]:
    """The model's trainable parameters, which must be exactly the optimizer's (an optimizer
    that has not stepped). Raises UsageError."""
    if not isinstance(model, nn.Module):
        raise UsageError(f"wrap: model is a {type(model).__name__}, not a torch.nn.Module")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UsageError(f"wrap: optimizer is a {type(optimizer).__name__}, not a torch.optim.Optimizer")
    if getattr(optimizer, "_ako_loop", None) is not None or getattr(model, "_ako_loop", None) is not None:
        raise UsageError("wrap: this model or optimizer is wrapped already")
    if len(optimizer.state) or getattr(optimizer, "_opt_called", False):
        raise UsageError(f"wrap: the optimizer ({type(optimizer).__name__}) has stepped already; wrap the model and "
                         "optimizer before the first optimizer.step(), so that every replica starts alike")  # fmt: skip
    if isinstance(optimizer, torch.optim.LBFGS):
        raise UsageError("wrap: LBFGS steps with a closure that evaluates the loss again; ako steps once per gradient")
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise UsageError("wrap: the model has no trainable parameters")
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    names = {id(p): name for name, p in model.named_parameters()}
    missing = [names[id(p)] for p in trainable if id(p) not in held]
    if missing:
        raise UsageError(f"wrap: the optimizer does not hold parameter {missing[0]!r} of the model "
                         f"({len(missing)} of {len(trainable)} not held); give it model.parameters()")  # fmt: skip
    if held - {id(p) for p in trainable}:
        raise UsageError(f"wrap: the optimizer holds {len(held - {id(p) for p in trainable})} tensors that are not "
                         "trainable parameters of the model")  # fmt: skip
    return trainable


def _wrap(model, optimizer, loaders, strategy, settings):
    trainable = _check_pair(model, optimizer)
    rank, world = _environment_world()
    config, own = _config(strategy, settings, world, optimizer)
    record_every = own.get("record_every", DEFAULT_RECORD_EVERY)
    if not (isinstance(record_every, int) and record_every >= 1):
        raise UsageError(f"record_every {record_every!r}: must be an integer >= 1 (steps)")
    sharded = [shard(data, seed=config.seed) for data in loaders]
    if any(p.dtype != torch.float32 for p in trainable):
        raise UsageError("wrap: ako keeps float32 parameters (a flat float32 vector); use autocast for lower precision")
    loop = Loop(model, optimizer, config, rank, world, own.get("out_dir"), record_every)
    return (model, optimizer, *sharded)


def _loop_of(thing) -> Loop:
    loop = getattr(thing, "_ako_loop", None)
    if loop is None:
        _usage(f"finish: this {type(thing).__name__} was not wrapped by ako.wrap")
    return loop


class Loop:
    """One wrapped model and optimizer: the process's place in the job, its runtime and the
    `LoopDriver` of its worker program; rank 0 also keeps the run directory's records."""

    def __init__(self, model: nn.Module, optimizer, config: TrainConfig, rank: int, world: int, out_dir: str | None,
                 record_every: int):  # fmt: skip
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
        quiet.drop_gloo_lines()
        self.model, self.optimizer, self.config, self.rank = model, optimizer, config, rank
        self.strategy = STRATEGIES[config.strategy]
        self.record_every = record_every
        self.user_step = optimizer.step  # the class's step, or a schedule's wrapper of it
        self.optimization = UserOptimization(optimizer, self.user_step)
        self.replica = Replica(model, self.optimization)
        self.replica.optimizer.grad = self.replica.grad
        if self.strategy.check is not None:  # what needs the model (its size, its modules), as ako train checks it
            try:
                self.strategy.check(config, self.replica)
            except ConfigError as e:
                raise UsageError(str(e)) from None
        self.started = time.perf_counter()
        n = config.workers
        device = self.replica.params.device
        own_group = not dist.is_initialized()
        startup = startup_timeout(config.timeout)
        self.own_group = own_group
        try:
            if own_group:
                backend = "gloo" if device.type == "cpu" else "cpu:gloo,cuda:nccl"
                _, _, store = join_process_group(startup, backend)
            else:
                store = dist.distributed_c10d._get_default_store()
            self.store = store
            self.runtime = DistributedRuntime(rank, world, config.timeout, device, self.strategy.survives(config), n, startup)
            liveness.record(store, rank)
            self.runtime.mailbox.whereabouts = lambda r: liveness.whereabouts(store, r)
            self.runtime.broadcast(self.replica.params)  # every replica starts as rank 0's, as DDP's do
            for buffer in model.buffers():
                self.runtime.broadcast(buffer)
            self.run_dir = self._run_dir(out_dir) if rank == 0 else None
            self.runtime.barrier()
            self.runtime.started()
            if rank == 0:  # for `ako run`, from the first step on: is a lost worker survived
                survives = str(int(self.strategy.survives(config)))
                self.runtime.on_first_step = lambda: store.set(SURVIVES_KEY, survives)
        except (RuntimeError, dist.DistError) as e:
            self._fail(RuntimeError(f"the workers did not all get ready within {startup:g} s: {comm_error(e)}"))
        self.runtime.clock.begin()
        if rank >= n:
            self._serve()
        self.replicas = MailboxReplicas(self.runtime.mailbox, n) if self.strategy.replicas_differ and out_dir else None
        self.kept: dict[int, tuple[dict, torch.Tensor]] = {}  # rank 0: point -> (record, own replica)
        self.records: list[dict] = []
        self.state = _Progress()
        self.runtime.state = self.state
        ctx = WorkerContext(rank, n, self.replica, config, lambda: self.driver is not None and self.driver.finishing,
                            list(range(n, world)))
        slowdown = Slowdown([parse_straggler(t) for t in config.straggler], rank, config.seed)
        if rank == 0:
            print(f"ako: your loop runs {config.strategy} on {n} worker{'s' if n != 1 else ''}{self._notice()}", file=sys.stderr, flush=True)
        self.driver = None
        self.driver = self._guarded(lambda: LoopDriver(self.runtime, self.strategy.worker, ctx, self.replica, slowdown,
                                                       self._stepped))  # fmt: skip
        # nanoGPT's way to say no_sync under DDP: model.require_backward_grad_sync = False
        self.driver.guard = self._guarded
        self.driver.wants_sync = lambda: getattr(model, "require_backward_grad_sync", True) is not False
        self.finished = False
        self._watch_the_exit()
        self._patch()

    def _watch_the_exit(self) -> None:
        """A script that ends before `ako.finish` (an exception, sys.exit) would tear down under
        the communication threads, which aborts (SIGABRT) and hides why: end it here instead,
        naming the cause (exit status 1), as a failure inside ako is named."""
        hook = sys.excepthook

        def raised(kind, value, tb):
            hook(kind, value, tb)
            if not self.finished:
                said = f": {one_line(value)}" if str(value).strip() else ""  # a bare KeyboardInterrupt has no message
                self._fail(RuntimeError(f"the script raised {kind.__name__}{said}"))

        def left():
            if not self.finished:
                self._fail(RuntimeError("the script ended before ako.finish (sys.exit, or the loop returned early)"))

        sys.excepthook = raised
        atexit.register(left)  # registered after torch's handlers, so it runs before them (last in, first out)

    def _notice(self) -> str:
        if self.config.strategy == "ako":
            return "; partial steps behind a straggler are off (they need ako to own the batch)"
        return ""

    def _run_dir(self, out_dir: str | None) -> Path | None:
        if out_dir is None:
            return None
        run_dir = create_run_dir(out_dir, self.config.strategy)
        write_atomic(run_dir / "config.toml", to_toml(self.config))
        self.store.set(RUN_DIR_KEY, str(run_dir))
        return run_dir

    def _serve(self) -> None:
        """A server rank: run the server program until the workers are done, then end."""
        n = self.config.workers
        servers = list(range(n, self.runtime.world_size))
        sctx = ServerContext(self.rank, self.rank - n, servers, list(range(n)), self.replica, self.config)
        facts = self._guarded(lambda: self.runtime.run(self.strategy.server, sctx, None))
        self._guarded(lambda: self.runtime.gather_reports(facts, None))
        self.runtime.close()
        _exit(0)

    # --- the patched methods -----------------------------------------------------------------

    def _patch(self) -> None:
        self.model._ako_loop = self.optimizer._ako_loop = self
        self.optimizer.step = types.MethodType(_step, self.optimizer)  # a method: a schedule made later wraps it
        self.optimizer.zero_grad = types.MethodType(_zero_grad, self.optimizer)
        self.model.zero_grad = types.MethodType(_zero_grad, self.model)
        self.model.no_sync = types.MethodType(_no_sync, self.model)

    def _unpatch(self) -> None:
        for name in ("step", "zero_grad"):
            self.optimizer.__dict__.pop(name, None)
        for name in ("zero_grad", "no_sync"):
            self.model.__dict__.pop(name, None)
        self.model._ako_loop = self.optimizer._ako_loop = None

    def step(self) -> None:
        self._guarded(self.driver.step)

    def zero_grad(self) -> None:
        """Zero the flat gradient, whose views every parameter's `.grad` is again (set_to_none
        would leave backward to allocate new gradients, which the hooks then copy back)."""
        for param, view in zip(self.driver.tensors, self.driver.views):
            if param.grad is not view:
                param.grad = view
        self.replica.grad.zero_()

    # --- records and the end -------------------------------------------------------------------

    def _stepped(self, steps: int) -> None:
        self.state.cursor.step = steps
        if self.record_every and steps % self.record_every == 0:
            self._record(steps // self.record_every)

    def _record(self, point: int) -> None:
        """Every `record_every` steps: rank 0 records time and bytes, and (where replicas
        differ) keeps its replica for the consensus distance, which the others send it."""
        if self.rank != 0:
            if self.replicas is not None:
                self.replicas.report_replica(point, self.replica.params)
            return
        if self.run_dir is None:
            return
        sent, received = self.runtime.bytes_moved()
        record = {"time": round(time.perf_counter() - self.started, 4), "step": point * self.record_every,
                  "bytes_sent": sent, "bytes_received": received}  # fmt: skip
        if self.replicas is None:
            self._log(record)
            return
        self.kept[point] = (record, self.replica.params.detach().to("cpu", copy=True))
        self._settle_points(final=False)

    def _settle_points(self, final: bool) -> None:
        for point in sorted(self.kept):
            others = self.replicas.peer_replicas(point, final)
            if others is None:
                return
            record, mine = self.kept.pop(point)
            distance, _ = consensus_distance([mine, *others])
            self._log({**record, "consensus_distance": round(distance, 8), "replicas": 1 + len(others)})

    def _log(self, record: dict) -> None:
        self.records.append(record)
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")  # one write of a whole line

    def finish(self) -> nn.Module:
        self.finished = True
        facts = self._guarded(self.driver.finish)
        self.runtime.clock.stop()
        if self.replicas is not None:
            self.replicas.send_held()
        differ = self.strategy.replicas_differ
        reports, finals = self._guarded(lambda: self.runtime.gather_reports(facts, self.replica.params if differ else None))
        if self.rank == 0:
            if self.replicas is not None and self.run_dir is not None:
                self._settle_points(final=True)
            self._hand_back(facts, reports, finals)
        lost = bool(self.runtime.mailbox.lost)
        self.runtime.close()
        self._unpatch()
        quiet.drain()
        if self.own_group and not lost:
            try:
                dist.destroy_process_group()
            except (RuntimeError, dist.DistError):
                pass
        return self.model

    def _hand_back(self, facts: dict, reports: list[dict], finals: list[torch.Tensor]) -> None:
        """Rank 0: make its model the run's (EASGD's centre, or the replicas' average where they
        differ) and write the summary."""
        summary = {"strategy": self.config.strategy, "workers": self.config.workers,
                   "train_seconds": round(self.runtime.clock.now(), 3)}  # fmt: skip
        if finals:
            weights = [r.get("average_weight", 1.0) for r in reports if r["role"] == "worker"]
            weights = weights if len(weights) == len(finals) else None
            distance, average = consensus_distance([f.to(self.replica.params.device) for f in finals], weights)
            summary["final_consensus_distance"] = round(distance, 8) if math.isfinite(distance) else None  # diverged: JSON has no NaN
            if "centre" in facts:
                self.replica.params.copy_(facts["centre"])
                summary["model"] = "the centre variable (easgd)"
            elif distance > 0:
                self.replica.params.copy_(average)
                summary["model"] = "the replicas' average"
            else:
                summary["model"] = "rank 0's replica (the replicas are equal)"
        else:
            summary["model"] = "rank 0's replica (the replicas are equal)"
        workers = [r for r in reports if r["role"] == "worker"]
        seconds = max(self.runtime.clock.now(), 1e-9)
        summary["steps_per_worker"] = [r["steps"] for r in workers]
        summary["bytes_sent_per_worker_per_second"] = round(sum(r["bytes_sent"] for r in workers) / len(workers) / seconds)
        summary["lost"] = sorted(self.runtime.mailbox.lost)
        if self.strategy.summarise is not None:
            summary.update(self.strategy.summarise(reports))
        summary.update(iterations=reports[0]["steps"], **strategy_facts(reports))
        summary["per_rank"] = reports
        plan = "".join(f"\n{line}" for line in plan_lines(summary))  # p, s, outer steps: what the strategy chose
        if self.run_dir is not None:
            write_atomic(self.run_dir / "summary.json", json.dumps(summary, indent=2))
            print(f"ako: the synchronisation metrics are in {self.run_dir}{plan}", file=sys.stderr, flush=True)
        elif plan:
            print(f"ako: {self.config.strategy}{plan}", file=sys.stderr, flush=True)
        self.summary = summary

    # --- failures ----------------------------------------------------------------------------

    def _guarded(self, fn):
        try:
            return fn()
        except EXPECTED_FAILURES as e:
            self._fail(e)

    def _fail(self, e: BaseException):
        """End this process with one line naming its rank: on stderr, or under `ako run` in
        the store for the launcher, which reports the cause once."""
        if os.environ.get("AKO_DEBUG"):
            raise e
        line = one_line(e)
        said = False
        if os.environ.get(LAUNCHER_ENV):
            time.sleep(1.0)  # often this rank only met another's death: the launcher sees that one first
            try:
                self.store.set(f"{FAILED_KEY}{self.rank}", line)
                said = True
            except Exception:  # noqa: BLE001 - the launcher is gone: say it here
                pass
        if not said:
            print(f"ako: rank {self.rank}: {line}", file=sys.stderr, flush=True)
        _exit(0 if isinstance(e, Dropped) and not os.environ.get(LAUNCHER_ENV) else 1)


class _Cursor:
    """What `outcome.rank_report` reads of a worker's cursor: the user's loop owns the data."""

    step = samples = cut = batch_size = 0


class _Progress:
    """The worker's state as the runtime's reports see it (no cursor of ako's own)."""

    def __init__(self):
        self.cursor = _Cursor()


def _exit(status: int) -> None:
    """End the process now: receive threads may be blocked on a dead peer, and tearing down
    under them can wait for ever (as `launcher._exit_now`)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    quiet.drain()
    os._exit(status)


def _step(optimizer, closure=None):
    """The wrapped optimizer's `step`: drive the strategy program (`LoopDriver.step`)."""
    if closure is not None:
        _usage("optimizer.step(closure): ako steps once per gradient, without a closure")
    optimizer._ako_loop.step()


def _zero_grad(owner, set_to_none: bool = True):
    owner._ako_loop.zero_grad()


@contextmanager
def _no_sync(model):
    """`with model.no_sync():` backward inside accumulates without reducing (as DDP's)."""
    with model._ako_loop.driver.no_sync():
        yield

