"""One process of a distributed job: join the process group, build the replica, run the
strategy program on a `DistributedRuntime`, and (rank 0) report.

`run_rank` is what every worker process runs, whether started by `launcher` on one machine
or by `torchrun` across machines: it joins the process group from the environment torch's
elastic agent sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ako.config import ConfigError, to_toml
from ako.metrics import write_atomic
from ako.run import lock
from ako.run.job import Job
from ako.run.evaluation import snapshots_kept
from ako.run.outcome import WorkerResult, final_summary, open_log, open_run_dir, publish
from ako.run.worker import WorkerState
from ako.runtime.distributed import checkpoint, liveness, quiet
from ako.runtime.distributed.mailbox import comm_error
from ako.runtime.distributed.replicas import MailboxReplicas
from ako.runtime.distributed.runtime import DistributedRuntime
from ako.strategies import ServerContext, WorkerContext


RUN_DIR_KEY = "ako/run_dir"  # in the job's store: the run directory, once rank 0 has made or found it


def join_process_group(timeout: float, backend: str) -> tuple[int, int, dist.Store]:
    """Join the job's process group from the elastic agent's environment; returns (rank, world,
    the agent's store: shared by every restart attempt).

    Each restart attempt uses its own key prefix in the agent's store: Gloo would otherwise
    read the previous attempt's stale addresses (docs/design.md, "Facts of torch.distributed").
    """
    world = _environment("WORLD_SIZE", 1, 1 << 20)
    rank = _environment("RANK", 0, world - 1)
    attempt = _environment("TORCHELASTIC_RESTART_COUNT", 0, 1 << 20, default="0")
    port = _environment("MASTER_PORT", 1, 65535)
    store = _connect_store(os.environ.get("MASTER_ADDR", "localhost"), port, world, timeout)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"ako/attempt{attempt}", store),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout),
    )
    return rank, world, store


def _environment(name: str, low: int, high: int, default: str | None = None) -> int:
    """An integer the elastic agent sets in the environment. Raises ConfigError, naming it."""
    text = os.environ.get(name, default)
    if text is None or not text.strip().isdigit() or not low <= int(text) <= high:
        raise ConfigError(f"environment variable {name}={text!r}: must be an integer from {low} to {high} (torchrun sets it)")
    return int(text)


def _connect_store(host: str, port: int, world: int, timeout: float) -> dist.Store:
    """The agent's TCPStore, as a client, within `timeout` seconds. The store's own timeout
    does not cover its handshake: a port held by something else that accepts the connection
    and never answers would block for ever, so the connection is made on a daemon thread."""
    result: list = []

    def connect():
        try:
            result.append(dist.TCPStore(host, port, world, is_master=False, timeout=timedelta(seconds=timeout)))
        except Exception as e:  # noqa: BLE001 - handed to the caller below
            result.append(e)

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    wait = timeout + 5  # the store's own retries (about `timeout`) first: their message says more
    thread.join(wait)
    if not result:
        raise RuntimeError(f"no answer from the store at {host}:{port} within {wait:.0f} s (is something else on that port?)")
    if isinstance(result[0], Exception):
        raise result[0]
    return result[0]


def pick_device(backend: str) -> tuple[str, torch.device]:
    """(process-group backend, device): NCCL and this process's GPU when CUDA is present and the
    backend is auto or nccl; otherwise Gloo on the CPU. Raises RuntimeError for nccl without CUDA."""
    if backend != "gloo" and torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        # collectives on CUDA tensors go to NCCL, the runtime's small CPU ones to Gloo
        return "cpu:gloo,cuda:nccl", torch.device("cuda", local)
    if backend == "nccl":
        raise RuntimeError("backend nccl needs CUDA, and torch.cuda.is_available() is false here")
    return "gloo", torch.device("cpu")


def name_process(name: str) -> None:
    """Show `name` as this process's name in ps and top (Linux), so ranks can be told apart."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # 15 = PR_SET_NAME


def workers_of(config, world: int | None = None) -> int:
    """How many of the job's `world` processes (default: the agent's WORLD_SIZE) are workers:
    the rest are `config.servers`. Raises ConfigError when none would be."""
    world = _environment("WORLD_SIZE", 1, 1 << 20) if world is None else world
    servers = config.servers or 0
    if world <= servers:
        raise ConfigError(f"servers {servers}: the world size {world} leaves no workers")
    return world - servers


def run_rank(job: Job) -> WorkerResult:
    """Run as one process of the job whose group the elastic agent's (or launcher's)
    environment describes: ranks below `config.workers` are workers, the rest servers."""
    torch.set_num_threads(1)  # one thread per worker process: more oversubscribes the cores
    quiet.drop_gloo_lines()
    try:
        return _run_rank(job)
    finally:
        lock.release_all()  # the run directory's, held by rank 0 (`_run_dir`)
        quiet.drain()  # the caller's stderr as it was (ako.train under torchrun runs in the user's process)


def _run_rank(job: Job) -> WorkerResult:
    config = job.config
    backend, device = pick_device(config.backend)
    startup = startup_timeout(config.timeout)
    try:
        rank, world, store = join_process_group(startup, backend)
    except (RuntimeError, dist.DistError) as e:
        raise RuntimeError(f"the workers did not all join within {startup:g} s: {comm_error(e)}") from None
    workers = workers_of(config, world)
    name_process(f"ako-{'rank' if rank < workers else 'server'}{rank}")
    result, lost = _train(replace(job, config=replace(config, workers=workers)), rank, world, device, store)
    # Only after success with every peer alive: a receive thread may be blocked on a stuck or
    # dead peer, and destroying the group under it could wait for ever; the process exits instead.
    if not lost:
        try:
            dist.destroy_process_group()
        except (RuntimeError, dist.DistError):  # a peer that ended first closed its connections: the run is done
            pass
    return result


START_FLOOR = 30.0  # seconds the start-up waits last at least, on one machine


def startup_timeout(timeout: float) -> float:
    """How long the waits before the first step last (seconds): `timeout` under torchrun, at
    least START_FLOOR under ako's own launcher. Processes start, import torch, load data and
    build models at their own pace, far apart on a loaded machine; the launcher sees at once a
    process that dies meanwhile, so only a stopped or stuck one waits this long."""
    return timeout if "TORCHELASTIC_RUN_ID" in os.environ else max(timeout, START_FLOOR)


def _train(job: Job, rank: int, world: int, device: torch.device, store: dist.Store) -> tuple[WorkerResult, bool]:
    data = job.load_data()
    job = job.resolved(data)
    config, strategy = job.config, job.strategy
    n = config.workers
    replica = job.build_replica(data, device)
    job.validate(data, replica)
    try:
        runtime = DistributedRuntime(rank, world, config.timeout, device, strategy.survives(config), n, startup_timeout(config.timeout))
        liveness.record(store, rank)
        runtime.mailbox.whereabouts = partial(liveness.whereabouts, store)
        runtime.mailbox.first_report = partial(liveness.first_report, store)
        runtime.broadcast(replica.params)  # identical replicas, whatever the model factory did
    except (RuntimeError, dist.DistError) as e:
        raise StartupFailed(f"the workers did not all get ready within {startup_timeout(config.timeout):g} s: {comm_error(e)}") from None
    identity = job.identity(replica.numel, data.name)  # what checkpoints of this run must agree with
    with _starting(runtime.limit):
        run_dir, point = _run_dir(job, data, rank, store, runtime, identity, replica.buffer_layout())
    log = open_log(run_dir, config) if rank == 0 else None
    saved = checkpoint.load(run_dir, point, rank) if point is not None else None
    # now: the newer checkpoints of a long run take the place of this one's directory
    restarted = checkpoint.stand_ins(run_dir, point) if point is not None else []
    if saved is not None:
        checkpoint.check(saved, identity, str(checkpoint.path(run_dir, point, rank)), contents=True)
    checkpoints = None
    if config.checkpoint_every is not None:
        checkpoints = checkpoint.Checkpoints(runtime, run_dir, config.checkpoint_seconds, identity, strategy.lockstep, store)
        runtime.checkpoints = checkpoints
    servers = list(range(n, world))
    if rank < n:
        replicas = None
        if strategy.replicas_differ:
            after_training = config.goal is None and checkpoints is None  # rank 0 evaluates then
            replicas = MailboxReplicas(runtime.mailbox, n, snapshots_kept(n, replica.grad_bytes) if after_training else 0)
        state = WorkerState(
            config=config, rank=rank, world_size=n, replica=replica, train_set=data.train, test_set=data.test,
            clock=runtime.clock, traffic=runtime.bytes_moved, on_target=runtime.request_stop, log=log,
            consensus=replicas, checkpointer=checkpoints, num_workers=config.num_workers,
            progress_bar=config.progress if config.progress is not None else quiet.on_terminal(),
        )  # fmt: skip
        program = strategy.worker
        ctx = WorkerContext(rank, n, replica, config, state.should_stop, servers, point or 0, state.plan_done)
    else:
        state, program, replicas = None, strategy.server, None
        restored = saved["shard"] if saved is not None else None
        on_update = checkpoints.on_update if checkpoints is not None else (lambda shard: None)
        ctx = ServerContext(rank, rank - n, servers, list(range(n)), replica, config, restored, on_update)
    runtime.state = state
    if saved is not None:
        with checkpoint.restoring(str(checkpoint.path(run_dir, point, rank))):
            runtime.restore(saved)
        if log is not None:
            log.resume(state.resumed[1])
    with _starting(runtime.limit):
        runtime.barrier()  # start the clocks together
    runtime.started()
    if rank == 0:  # from its first step on, the launcher lets a strategy go on without a lost worker
        runtime.on_first_step = partial(liveness.mark_started, store)
    if state is not None:
        runtime.clock.begin(state.resumed[1], state.resumed_wall)
    else:
        runtime.clock.begin()
    try:
        with _endable():
            facts = runtime.run(program, ctx, state)
    except (Exception, JobEnded):
        if state is not None and state.evaluator is not None:
            state.keep_metrics()  # a failed run keeps the metrics up to its failure
        raise
    runtime.clock.stop()
    if replicas is not None:
        replicas.send_held()
    final = replica.params if strategy.replicas_differ and state is not None else None
    reports, finals = runtime.gather_reports(facts, final)
    runtime.close()
    result = WorkerResult(rank, replica.params.cpu().clone(), facts)
    if rank == 0:
        lost = [liveness.with_cause(store, loss) for loss in runtime.mailbox.losses()]  # the launcher saw how
        finishing = time.perf_counter()
        result.summary, result.model, model = final_summary(job, data, state, reports, finals, facts, lost, run_dir, point,
                                                            restarted)  # fmt: skip
        s = result.summary  # evaluations during training (the clock's pauses) and after it
        s["evaluation_seconds"] = round(s["wall_seconds"] - s["train_seconds"] + time.perf_counter() - finishing, 3)
        publish(run_dir, result.summary, model=model, log=state.evaluator.log, retry_for=config.timeout)
    return result, bool(runtime.mailbox.lost)


class JobEnded(BaseException):
    """The launcher ended the job (another rank failed, and this strategy does not go on
    without it): raised in rank 0's main thread, so that it logs its metrics before it is
    stopped. A BaseException: no handler of an ordinary error on the way may swallow it."""


END = signal.SIGUSR1  # from the launcher: the job failed elsewhere (JobEnded)


@contextmanager
def _endable():
    """While training: `END` raises JobEnded here (in the main thread). Afterwards it is
    ignored: a rank already failing, or finished, logs its metrics in the launcher's grace
    time. (Before, the launcher's processes exit at once on it: nothing to log yet.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def end(signum, frame):
        signal.signal(END, signal.SIG_IGN)  # once
        raise JobEnded("the launcher ended the job (another rank failed, or Ctrl-C)")

    signal.signal(END, end)
    try:
        yield
    finally:
        signal.signal(END, signal.SIG_IGN)


class StartupFailed(RuntimeError):
    """The ranks could not start training together (one is gone, stopped or stuck before the
    first step): no strategy carries on from that, so the job ends."""


@contextmanager
def _starting(timeout: float):
    """Communication before the first step: a failure is StartupFailed (ConfigError stays)."""
    try:
        yield
    except ConfigError:
        raise
    except (RuntimeError, dist.DistError) as e:
        raise StartupFailed(f"the workers did not all get ready within {timeout:g} s: {comm_error(e)}") from None


def keep_earlier_config(run_dir: Path, text: str, point: int) -> None:
    """Write the resumed run's config.toml; settings that changed keep the earlier file as
    config.before-step-<point>.toml."""
    path = run_dir / "config.toml"
    if path.exists() and path.read_text() != text:
        os.replace(path, run_dir / f"config.before-step-{point}.toml")
    write_atomic(path, text)


def _run_dir(job: Job, data, rank: int, store: dist.Store, runtime: DistributedRuntime, identity: dict, buffers: dict):
    """(run directory, step of the checkpoint to resume from or None), the same on every rank.

    Rank 0 decides: `config.resume`'s latest complete checkpoint (fitting `identity` and the
    model's `buffers` layout: `checkpoint.find`); under a `torchrun` restart,
    the first attempt's run directory (found in the agent's store) and its latest complete
    checkpoint, if any; else a new run directory. The others learn the directory from the
    store (when they need it: checkpoints or a resume) and the step by broadcast."""
    config = job.config
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    key = RUN_DIR_KEY
    if rank == 0:
        if config.resume is not None:
            checkpoint.check_unfinished(config)
            run_dir, point = Path(config.resume), checkpoint.find(config.resume, identity, config.workers, True, buffers)
        elif attempt > 0 and store.check([key]):
            run_dir = Path(store.get(key).decode())
            found = checkpoint.latest(run_dir, identity["world"]) is not None
            point = checkpoint.find(run_dir, identity, config.workers, True, buffers) if found else None
        else:
            run_dir, point = open_run_dir(config, job.strategy.name, data), None
        lock.hold(run_dir)  # before anything is written into it: one writer per run directory
        if point is not None:  # checkpoints after `point` belong to the abandoned run: drop them
            checkpoint.drop_after(run_dir, point)
            keep_earlier_config(run_dir, to_toml(replace(config, resume=None)), point)
            print(f"ako: resuming {run_dir} from its checkpoint at step {point}", file=sys.stderr, flush=True)
        store.set(key, str(run_dir))
    found = runtime.broadcast(torch.tensor([-1 if rank != 0 or point is None else point]))
    point = None if found.item() < 0 else int(found.item())
    if rank != 0:
        run_dir = Path(store.get(key).decode()) if point is not None or config.checkpoint_every else None
    return run_dir, point
