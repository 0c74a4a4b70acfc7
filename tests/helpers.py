"""Shared pieces of the distributed tests: small configs, a gradient-recording strategy, and
the single-process SGD reference."""

from __future__ import annotations

import contextlib
import dataclasses

import os
import signal
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

from ako import TrainConfig
from ako.data import ShardSampler, fetch, load_dataset
from ako.models import build_model, model_options
from ako.config import SIMULATE_OPTIONS, TRAIN_OPTIONS, validate
from ako.optim import Optimization
from ako.replica import Replica
from ako.runtime.distributed import checkpoint
from ako.strategies import STRATEGIES, Strategy, gossip
from ako.strategies import ako as ako_strategy
from ako.strategies.ops import Compute, ComputePartial, Publish, Pull


def small_config(tmp_path, **overrides) -> TrainConfig:
    """2 workers, the cnn on a slice of digits, a handful of steps, no progress bar."""
    values = dict(
        workers=2,
        dataset="digits",
        model="cnn",
        train_samples=384,
        test_samples=60,
        batch_size=16,
        epochs=0.5,  # 384 / 2 / 16 = 12 steps per epoch -> 6 steps
        eval_every=10.0,
        lr=0.05,
        momentum=0.9,
        weight_decay=1e-3,
        timeout=30.0,
        out_dir=str(tmp_path / "runs"),
        progress=False,
    )
    values.update(overrides)
    return TrainConfig(**values)


def sum_gradients(op, result, log) -> None:
    """A `recorded` hook: the sum of every gradient a step used, float64 (numel,), as
    `grad_sum` (a partial step's: its sum over the samples done, over the step's samples);
    and the number of partial steps, as `partials`."""
    if isinstance(op, Compute):
        log["grad_sum"] = log.get("grad_sum", 0) + result.grad.double()
    elif isinstance(op, ComputePartial):
        log["grad_sum"] = log.get("grad_sum", 0) + result.grad_sum.double() / result.assigned
        log["partials"] = log.get("partials", 0) + 1


def make_replica(model, config: TrainConfig, steps: int = 1000) -> Replica:
    """A replica of `model` with `config`'s optimizer (and schedule over `steps` steps)."""
    plain = dataclasses.replace(config, **{k: None for k in SIMULATE_OPTIONS + TRAIN_OPTIONS})  # either runtime's
    return Replica(model, Optimization(validate(plain), steps))


def single_process_sgd(config: TrainConfig, steps: int, ranks=None) -> torch.Tensor:
    """Flat parameters after `steps` steps of SGD on the union of the mini-batches of workers
    `ranks` (default: all; each step: their batches of that step, concatenated)."""
    split = load_dataset(config.dataset, config.data_dir, config.train_samples, config.test_samples, config.context)
    torch.manual_seed(config.seed)
    model = build_model(config.model, split.input_shape, split.num_classes, **model_options(config.model, config))
    planned = max(1, round(config.epochs * (len(split.train) // config.workers // config.batch_size)))
    replica = make_replica(model, config, planned)  # the schedule spans the run's planned steps
    samplers = [
        ShardSampler(len(split.train), r, config.workers, config.batch_size, config.seed)
        for r in (range(config.workers) if ranks is None else ranks)
    ]
    for t in range(steps):
        idx = torch.cat([s.batch(t) for s in samplers])
        replica.compute_gradient([fetch(split.train, idx)])
        replica.step(replica.grad.clone())
    return replica.params.clone()


class DigitsAsList(torch.utils.data.Dataset):
    """A plain map-style data set (not a TensorDataset): items are (x, label) pairs."""

    def __init__(self, tensors: torch.utils.data.TensorDataset):
        self.items = list(zip(*tensors.tensors))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def digits_cnn() -> torch.nn.Module:
    """A user's model factory: here the registry's cnn for 8x8 digits."""
    return build_model("cnn", (1, 8, 8), 10)


def _perturbed_lr0(ctx):
    """Gossip with learning rate 0 from replicas made different on purpose (noise of std 0.05
    seeded by the rank), so that only the averaging moves them. Facts add the initial replica."""
    for group in ctx.replica.optimizer.optimizer.param_groups:
        group["lr"] = 0.0
    noise = torch.randn(ctx.replica.numel, generator=torch.Generator().manual_seed(1000 + ctx.rank))
    ctx.replica.params.add_(noise, alpha=0.05)
    initial = ctx.replica.params.clone()
    facts = yield from gossip.worker(ctx)
    return {**facts, "initial": initial}


GOSSIP_LR0 = Strategy(name="gossip", worker=_perturbed_lr0, replicas_differ=True, survives_loss=True)


class _Star:
    """Peer selection where every worker pulls from rank 0, and rank 0 from rank 1."""

    def __init__(self, rank: int):
        self.rank = rank

    def next(self, round_: int, lost) -> int:
        return 1 if self.rank == 0 else 0


def _star_pull(ctx):
    return (yield from gossip.pull(ctx, _Star(ctx.rank)))


STAR_PULL = Strategy(name="gossip", worker=_star_pull, replicas_differ=True, survives_loss=True)


def _late_publisher(ctx):
    """Rank 1 pulls from rank 0 at once; rank 0 trains 3 steps before its first publish, so
    the pull must wait for it. Facts: what rank 1 got, and what rank 0 published."""
    if ctx.rank == 0:
        for _ in range(3):
            g = yield Compute()
            ctx.replica.step(g.grad)
        published = ctx.replica.params.clone()
        yield Publish(published, 7)
        yield from gossip.handshake(ctx)
        return {"published": published}
    snapshot = yield Pull(0)
    yield from gossip.handshake(ctx)
    return {"pulled": snapshot.tensor, "pulled_step": snapshot.step}


LATE_PUBLISHER = Strategy(name="gossip", worker=_late_publisher, replicas_differ=True, survives_loss=True)


class recorded:
    """A worker program that runs `program` unchanged, calling `record(op, result, log)` after
    each operation (and `before(op, log)`, when given, before it); the dict `log` joins the
    program's facts (tensors come back by value). A class, not a closure, so that it pickles
    to the worker processes."""

    def __init__(self, program, record, before=None):
        self.program, self.record, self.before = program, record, before

    def __call__(self, ctx):
        log, gen, result = {}, self.program(ctx), None
        while True:
            try:
                op = gen.send(result)
            except StopIteration as done:
                return {**(done.value or {}), **log}
            if self.before is not None:
                self.before(op, log)
            result = yield op
            self.record(op, result, log)


RECORDED_AKO = replace(STRATEGIES["ako"], worker=recorded(ako_strategy.worker, sum_gradients))


def find_process(name: str, ancestor: int, deadline: float) -> int:
    """PID of the process under `ancestor` named `name` (workers name themselves ako-rank<R>,
    servers ako-server<R>; the launcher's fork server is their parent), waiting for it.
    Raises AssertionError when `ancestor` ends first, or at `deadline`."""
    while time.monotonic() < deadline and _running(ancestor):
        for pid in descendants(ancestor):
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                    return pid
            except OSError:
                continue
        time.sleep(0.1)
    raise AssertionError(f"no process {name} appeared" + ("" if _running(ancestor) else f" before process {ancestor} ended"))


def descendants(ancestor: int) -> list[int]:
    """The PIDs of every process under `ancestor` now (children, theirs, ...)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found, frontier = [], [ancestor]
    while frontier:
        children = [pid for pid, ppid in parents.items() if ppid in frontier]
        found += children
        frontier = children
    return found


def orphans_since(before: set[int], within: float) -> list[int]:
    """The processes of this session, not there in `before` (`session()`), that are not under
    this process `within` seconds from now (none left over: an empty list sooner)."""
    deadline = time.monotonic() + within
    while True:
        left = sorted(session() - before - set(descendants(os.getpid())) - {os.getpid()})
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def session() -> set[int]:
    """The PIDs of every live process (not a zombie) in this process's session now."""
    sid, found = os.getsid(0), set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:
            found.add(int(stat.parent.name))
    return found


def command_line(pid: int) -> str:
    """Process `pid`'s command line, its arguments joined by spaces ("" once it has ended)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def gone(pids: list[int], within: float) -> bool:
    """Whether every process in `pids` has ended (a zombie has) within `within` seconds."""
    deadline = time.monotonic() + within
    while any(_running(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for_metrics(out_dir: Path, deadline: float) -> None:
    """Until rank 0 has logged its first evaluation: training has started."""
    while time.monotonic() < deadline:
        if any(p.stat().st_size > 0 for p in out_dir.glob("*/metrics.jsonl")):
            return
        time.sleep(0.1)
    raise AssertionError("training did not start")


def wait_for_checkpoint(out_dir: Path, world: int, deadline: float) -> None:
    """Until a run under `out_dir` has a complete checkpoint (a file from each of `world` ranks)."""
    while time.monotonic() < deadline:
        for run_dir in out_dir.glob("*"):
            if checkpoint.latest(run_dir, world) is not None:
                return
        time.sleep(0.05)
    raise AssertionError("no complete checkpoint appeared")


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def run_and_kill(cmd: list[str], victim: str, out_dir: Path, settle: float = 0.0, limit: float = 90.0, ready=None,
                 sig=signal.SIGKILL, cont_after: float | None = None):  # fmt: skip
    """Start `cmd`, kill -9 (or send `sig` to) its child process named `victim` once
    `ready(out_dir, deadline)` returns (default: training has begun) and `settle` seconds more,
    and SIGCONT it `cont_after` seconds later if given; returns (exit status, stdout, stderr,
    seconds from the signal to the end)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        try:
            pid = find_process(victim, proc.pid, deadline)
        except AssertionError as e:  # say what the command printed: why it ended, or where it stood
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"{e}; exit status {proc.returncode}, stdout:\n{out}\nstderr:\n{err}") from None
        (ready or wait_for_metrics)(out_dir, deadline)
        time.sleep(settle)
        killed = time.monotonic()
        os.kill(pid, sig)
        if cont_after is not None:
            threading.Timer(cont_after, _signal, (pid, signal.SIGCONT)).start()
        out, err = proc.communicate(timeout=limit)
        elapsed = time.monotonic() - killed
    finally:
        proc.kill()
        proc.wait()
    return proc.returncode, out, err, elapsed


def default_sigint() -> None:
    """Popen's `preexec_fn`: SIGINT as a terminal's foreground command gets it. A shell starts
    a background job (`make test &`) with SIGINT ignored, which every process under it
    inherits; a test that sends Ctrl-C would then test nothing, or wait for nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
