"""The distributed runtime: one worker process on torch.distributed (Gloo on CPU, NCCL on GPU).

`run_worker` is what every worker process runs, whether started by `ako.runtime.launcher` on
one machine or by `torchrun` across machines: it joins the process group from the environment
torch's elastic agent sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), builds the replica and
carries out the strategy program's operations (`DistributedRuntime.run`).
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ako.config import ConfigError, to_toml
from ako.data import fetch
from ako.metrics import MetricsLog, build_summary, create_run_dir, format_summary, write_atomic, write_summary
from ako.runtime.consensus import MailboxReplicas
from ako.runtime.job import Job
from ako.runtime import checkpoint
from ako.runtime.mailbox import CHECKPOINT, FINAL, PROBE, PULL, REPORT, SNAPSHOT, STOP, Mailbox, comm_error
from ako.runtime.worker import Clock, WorkerState
from ako.strategies import ServerContext, WorkerContext
from ako.strategies.ops import (
    AllReduce,
    Compute,
    ComputePartial,
    Gradient,
    Lost,
    MeasureBandwidth,
    MeasureStep,
    PartialGradient,
    PeerLost,
    Poll,
    Publish,
    Pull,
    Recv,
    Send,
    Snapshot,
    Wait,
)

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
_PROBE_BYTES = 4 << 20


def join_process_group(timeout: float, backend: str) -> tuple[int, int, dist.Store]:
    """Join the job's process group from the elastic agent's environment; returns (rank, world,
    the agent's store: shared by every restart attempt).

    Each restart attempt uses its own key prefix in the agent's store: Gloo would otherwise
    read the previous attempt's stale addresses (engine-facts.md, torchrun --max-restarts).
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
    wait = 2 * timeout + 10  # the store's own retries first: their message says more
    thread.join(wait)
    if not result:
        raise RuntimeError(f"no answer from the store at {host}:{port} within {wait:.0f} s (is something else on that port?)")
    if isinstance(result[0], Exception):
        raise result[0]
    return result[0]


class DistributedRuntime:
    """Carries out a strategy program's operations for this process (a worker or a server).

    `timeout` bounds every wait (seconds). The mailbox runs on a process group of its own.
    With `survives_loss`, a dead peer is not an error: `Poll` leaves it out, a `Send` to it is
    dropped, and only a `Recv` that waits on it (or on anyone, when every peer is dead) fails.
    """

    def __init__(self, rank: int, world_size: int, timeout: float, device: torch.device, survives_loss: bool = False):
        self.rank, self.world_size, self.timeout, self.device = rank, world_size, timeout, device
        self.survives_loss = survives_loss
        self.collective_bytes = 0  # as a ring all-reduce moves them: 2 (n-1)/n x bytes each way
        self.bytes_before = (0, 0)  # (sent, received) before a resumed run's checkpoint
        self.state: WorkerState | None = None
        self.clock = Clock()
        # checkpoints (`ako.runtime.checkpoint`): where, how often, what must match, when next
        self.run_dir: Path | None = None
        self.every = math.inf
        self.identity: dict = {}
        self.checkpoint_at: int | None = None
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        peers = [r for r in range(world_size) if r != rank]
        self.mailbox = Mailbox(rank, peers, group, timeout, self._stop_requested, self._checkpoint_called)

    def _stop_requested(self) -> None:
        if self.state is not None:
            self.state.stop_requested = True

    def _checkpoint_called(self, point: int) -> None:
        self.checkpoint_at = point
        if self.state is not None:
            self.state.checkpoint_at = point

    def announce(self, point: int) -> None:
        """Rank 0: tell every other rank to save its part of the checkpoint at step `point`."""
        for peer in self.mailbox.peers:
            if peer not in self.mailbox.lost:
                self.mailbox.send(torch.empty(0), peer, CHECKPOINT, step=point, drop_lost=True)

    def save(self, point: int, shard=None) -> None:
        """Save this rank's part of the checkpoint at step `point`: a worker's replica and
        place in the run, or a server's `shard`."""
        if self.state is not None:
            replica = self.state.replica
            own = {
                "role": "worker",
                "params": replica.params.detach().cpu().clone(),
                "optimizer": replica.optimizer.state_dict(),
                "worker": self.state.state_dict(),
            }
        else:
            own = {"role": "server", "shard": shard.state_dict()}
        state = {**self.identity, **own, "bytes": list(self.bytes_moved())}
        checkpoint.save(self.run_dir, point, self.rank, self.world_size, state)

    def on_update(self, shard) -> None:
        """A server's shard was updated: save it if a checkpoint is due at its version."""
        if self.checkpoint_at is not None and shard.version >= self.checkpoint_at:
            point, self.checkpoint_at = self.checkpoint_at, None
            self.save(point, shard)

    def restore(self, state: dict) -> None:
        """Continue from this rank's part of a checkpoint (a worker's; a server's shard is
        restored by its program, from `ServerContext.restored`)."""
        self.bytes_before = tuple(int(b) for b in state["bytes"])
        if self.state is not None:
            replica = self.state.replica
            replica.params.copy_(state["params"])
            replica.optimizer.load_state_dict(state["optimizer"])
            self.state.load_state_dict(state["worker"])

    def request_stop(self) -> None:
        """Tell every peer to stop (rank 0 reached the target accuracy)."""
        for peer in self.mailbox.peers:
            if peer not in self.mailbox.lost:
                self.mailbox.send(torch.empty(0), peer, STOP)

    def bytes_moved(self) -> tuple[int, int]:
        """(sent, received) bytes so far, payloads plus collectives."""
        c, (sent, received) = self.collective_bytes, self.bytes_before
        return sent + self.mailbox.bytes_sent + c, received + self.mailbox.bytes_received + c

    def run(self, program, ctx, state: WorkerState | None) -> dict:
        """Drive the generator `program(ctx)` to its end; returns what it returns. `state` is
        None for a server (it computes nothing). A `PeerLost` is raised inside the program, at
        the operation that met it."""
        self.state = state
        gen = program(ctx)
        result, lost = None, None
        while True:
            try:
                op = gen.send(result) if lost is None else gen.throw(lost)
            except StopIteration as done:
                return done.value or {}
            try:
                result, lost = self.execute(op), None
            except PeerLost as e:  # raised inside the program, which may carry on without the peer
                result, lost = None, e

    def execute(self, op):
        """Carry out one operation of `ako.strategies.ops` and return its result."""
        match op:
            case Compute():
                return self.compute()
            case ComputePartial(micro_batch, stop_tag, iteration):
                return self.compute_partial(micro_batch, stop_tag, iteration)
            case Send(tensor, dst, tag, step, aux):
                if not (self.survives_loss and dst in self.mailbox.lost):
                    self.mailbox.send(tensor.cpu(), dst, tag, step, aux, drop_lost=self.survives_loss)
                return None
            case Recv(tag, src):
                return self._to_device(self.receive(tag, src))
            case Poll(tag):
                return [self._to_device(m) for m in self.mailbox.poll(tag, tolerant=self.survives_loss)]
            case Lost():
                with self.mailbox.cond:
                    self.mailbox.told.update(self.mailbox.lost)
                    return frozenset(self.mailbox.lost)
            case Publish(tensor, step):
                self.mailbox.publish(tensor.detach().to("cpu", copy=True), step)
                return None
            case Pull(src):
                return self.pull(src)
            case AllReduce(tensor, reduce, wait):
                return self.all_reduce(tensor, reduce, wait=wait)
            case Wait(handle):
                return self._wait(handle)
            case MeasureStep():
                return self.measure_step()
            case MeasureBandwidth():
                return self.measure_bandwidth()
        raise TypeError(f"unknown operation {op!r}")

    def receive(self, tag: int, src: int | None):
        """`ops.Recv`. A strategy that survives losses carries on without a peer that stays
        silent for the timeout while it waits on that peer (stopped or stuck): it is lost."""
        try:
            return self.mailbox.get(tag, src, self.timeout, tolerant=self.survives_loss)
        except TimeoutError:
            if not (self.survives_loss and src is not None):
                raise
            reason = f"silent for {self.timeout:g} s (stopped or stuck)"
            with self.mailbox.cond:
                self.mailbox.lost.setdefault(src, reason)
                self.mailbox.told.add(src)
            raise PeerLost(src, reason) from None

    def pull(self, src: int) -> Snapshot:
        """Request `src`'s published snapshot and wait for it (see `ops.Pull`)."""
        if src in self.mailbox.lost:
            raise PeerLost(src, self.mailbox.lost[src])
        self.mailbox.send(torch.empty(0), src, PULL, drop_lost=self.survives_loss)
        message = self.mailbox.get(SNAPSHOT, src, self.timeout)
        return Snapshot(src, message.step, message.tensor.to(self.device))

    def compute(self) -> Gradient:
        """Forward and backward on the next mini-batch, slowed as the cluster says."""
        state = self.state
        x, y = state.next_batch()
        slow = state.slowdown.factor() if state.slowdown.active else 1.0
        loss = self._gradient(x, y, slow)
        state.computed(loss)
        return Gradient(state.replica.grad, loss, len(y))

    def compute_partial(self, micro_batch: int, stop_tag: int, iteration: int) -> PartialGradient:
        """A-BSP's interruptible computation (see `ops.ComputePartial`)."""
        state = self.state
        indices, since = state.next_assignment()
        slow = state.slowdown.factor() if state.slowdown.active else 1.0
        grad_sum = torch.zeros_like(state.replica.grad)
        done, loss_sum = 0, 0.0
        for chunk in indices.split(micro_batch):
            if done and self._told_to_stop(stop_tag, iteration):
                break
            x, y = fetch(state.train_set, chunk)
            loss_sum += self._gradient(x, y, slow) * len(y)
            grad_sum.add_(state.replica.grad, alpha=len(y))
            done += len(y)
        oldest = state.processed(indices, since, done)
        state.computed(loss_sum / done)
        return PartialGradient(grad_sum, loss_sum / done, done, indices, oldest)

    def _told_to_stop(self, tag: int, iteration: int) -> bool:
        messages = self.mailbox.poll(tag, tolerant=self.survives_loss)
        return any(m.step == iteration for m in messages)

    def _gradient(self, x: torch.Tensor, y: torch.Tensor, slow: float) -> float:
        """Gradient of one batch into the replica's buffer; a straggler then waits (slow - 1)
        times the compute time it took (the cluster model of DESIGN.md)."""
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        start = time.perf_counter()
        loss = self.state.replica.compute_gradient(x, y)
        if slow > 1.0:
            time.sleep((slow - 1.0) * (time.perf_counter() - start))
        return loss

    def _to_device(self, message):
        if message.tensor.device == self.device:
            return message
        return replace(message, tensor=message.tensor.to(self.device))

    def all_reduce(self, tensor: torch.Tensor, reduce: str = "sum", count: bool = True, wait: bool = True):
        """In-place all-reduce with a deadline of `timeout` seconds; `count` adds its bytes to
        the traffic counters (not for the runtime's own barriers). With `wait=False` returns a
        handle for `_wait` at once (Gloo runs the collective on its own threads)."""
        try:
            work = dist.all_reduce(tensor, op=_REDUCE_OPS[reduce], async_op=True)
        except RuntimeError as e:
            raise RuntimeError(f"all-reduce failed, a worker is gone or stuck: {comm_error(e)}") from None
        if count:
            n = self.world_size
            self.collective_bytes += 2 * (n - 1) * tensor.numel() * tensor.element_size() // n
        return self._wait((work, tensor)) if wait else (work, tensor)

    def _wait(self, handle) -> torch.Tensor:
        work, tensor = handle
        try:
            work.wait(timedelta(seconds=self.timeout))
        except RuntimeError as e:
            raise RuntimeError(f"all-reduce failed, a worker is gone or stuck: {comm_error(e)}") from None
        return tensor

    def barrier(self) -> None:
        """Wait until every worker gets here (at most `timeout` seconds)."""
        self.all_reduce(torch.zeros(1), count=False)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Copy rank `src`'s `tensor` into every worker's, in place (deadline `timeout`)."""
        dist.broadcast(tensor, src, async_op=True).wait(timedelta(seconds=self.timeout))
        return tensor

    def measure_step(self, repeats: int = 3) -> float:
        """Median seconds of forward+backward on one mini-batch (after one warm-up); the
        replica's parameters are not changed."""
        state = self.state
        x, y = fetch(state.train_set, torch.arange(state.config.batch_size))
        x, y = x.to(self.device), y.to(self.device)
        state.replica.compute_gradient(x, y)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            state.replica.compute_gradient(x, y)
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    def measure_bandwidth(self, repeats: int = 3) -> float:
        """Bytes per second of this worker's link, from a ring probe: every worker sends 4 MB to
        the next rank and receives from the previous one at the same time. Best of `repeats`."""
        n = self.world_size
        if n == 1:
            return float("inf")
        probe = torch.zeros(_PROBE_BYTES // 4)
        best = 0.0
        for _ in range(repeats):
            self.barrier()  # start together
            t = time.perf_counter()
            self.mailbox.send(probe, (self.rank + 1) % n, PROBE)
            self.mailbox.get(PROBE, (self.rank - 1) % n, self.timeout)
            best = max(best, _PROBE_BYTES / (time.perf_counter() - t))
        return best

    def finish(self, facts: dict, params: torch.Tensor | None) -> tuple[list[dict], list[torch.Tensor]]:
        """After training: every rank reports to rank 0 by message (no collective, so a dead
        peer cannot block it) its role, steps, samples, bytes and scalar facts, and, when
        `params` is given (decentralised strategies), its final parameters (numel,).

        Returns, on rank 0, one report per live rank (by rank) and the live workers' parameters;
        elsewhere ([], []). Ranks that died are in `self.mailbox.lost`."""
        report = self._own_report(facts)
        if self.rank != 0:
            self.mailbox.send(_encode(report), 0, REPORT)
            if params is not None:
                self.mailbox.send(params.cpu(), 0, FINAL)
            return [], []
        reports, finals = [report], [] if params is None else [params.cpu()]
        for peer in self.mailbox.peers:
            try:
                report = _decode(self.mailbox.get(REPORT, peer, self.timeout).tensor)
                if params is not None and report["role"] == "worker":
                    finals.append(self.mailbox.get(FINAL, peer, self.timeout).tensor)
                reports.append(report)  # after its final: reports and finals stay in step
            except PeerLost:
                if not self.survives_loss:
                    raise
        return reports, finals

    def _own_report(self, facts: dict) -> dict:
        state = self.state
        sent, received = self.bytes_moved()
        scalars = {k: v for k, v in facts.items() if isinstance(v, (str, int, float, bool))}
        return {
            **scalars,
            "rank": self.rank,
            "role": "worker" if state is not None else "server",
            "steps": state.step if state is not None else 0,
            "samples": state.samples if state is not None else 0,
            "bytes_sent": sent,
            "bytes_received": received,
        }

    def close(self) -> None:
        """Say goodbye to every peer and wait for theirs (at most `timeout` seconds)."""
        self.mailbox.close(self.timeout)


def _encode(report: dict) -> torch.Tensor:
    """A report as a uint8 tensor of its JSON text (nothing received is ever unpickled)."""
    return torch.tensor(list(json.dumps(report).encode()), dtype=torch.uint8)


def _decode(tensor: torch.Tensor) -> dict:
    return json.loads(bytes(tensor.tolist()).decode())


@dataclass
class WorkerResult:
    """What a worker process hands back: its rank, its final flat parameters (numel,), the
    strategy's facts and, on rank 0, the run summary."""

    rank: int
    params: torch.Tensor
    facts: dict
    summary: dict | None = None


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


def run_worker(job: Job) -> WorkerResult:
    """Run as one process of the job whose group the elastic agent's (or launcher's)
    environment describes: ranks below `config.workers` are workers, the rest servers."""
    torch.set_num_threads(1)  # one thread per worker process: more oversubscribes the cores
    config = job.config
    backend, device = pick_device(config.backend)
    try:
        rank, world, store = join_process_group(config.timeout, backend)
    except (RuntimeError, dist.DistError) as e:
        raise RuntimeError(f"the workers did not all join within {config.timeout:g} s: {comm_error(e)}") from None
    servers = config.servers or 0
    if world <= servers:
        raise ConfigError(f"servers {servers}: the world size {world} leaves no workers")
    name_process(f"ako-{'rank' if rank < world - servers else 'server'}{rank}")
    result, lost = _train(replace(job, config=replace(config, workers=world - servers)), rank, world, device, store)
    # Only after success with every peer alive: a receive thread may be blocked on a stuck or
    # dead peer, and destroying the group under it could wait for ever; the process exits instead.
    if not lost:
        dist.destroy_process_group()
    return result


def _train(job: Job, rank: int, world: int, device: torch.device, store: dist.Store) -> tuple[WorkerResult, bool]:
    data = job.load_data()
    # what the run really used: the data set `auto` chose, the user's own model or data
    model = "custom" if job.model_fn is not None else job.config.model
    job = replace(job, config=replace(job.config, dataset=data.name, model=model))
    config, strategy = job.config, job.strategy
    n = config.workers
    replica = job.build_replica(data, device)
    job.validate(data, replica.numel)
    try:
        runtime = DistributedRuntime(rank, world, config.timeout, device, strategy.survives_loss)
        runtime.broadcast(replica.params)  # identical replicas, whatever the model factory did
    except (RuntimeError, dist.DistError) as e:
        raise RuntimeError(f"the workers did not all get ready within {config.timeout:g} s: {comm_error(e)}") from None
    identity = job.identity(replica.numel)  # what checkpoints of this run must agree with
    run_dir, point = _run_dir(job, data, rank, store, runtime, identity)
    log = MetricsLog(run_dir / "metrics.jsonl") if rank == 0 else None
    saved = checkpoint.load(run_dir, point, rank) if point is not None else None
    if saved is not None:
        checkpoint.check(saved, identity, str(checkpoint.path(run_dir, point, rank)), contents=True)
    checkpointer = None
    if config.checkpoint_every is not None:
        runtime.run_dir, runtime.every, runtime.identity = run_dir, config.checkpoint_seconds, identity
        checkpointer = runtime
    servers = list(range(n, world))
    if rank < n:
        replicas = MailboxReplicas(runtime.mailbox, n) if strategy.decentralised else None
        state = WorkerState(
            config, rank, n, data.train, data.test, replica, runtime.clock, log, runtime.bytes_moved,
            runtime.request_stop, replicas, checkpointer,
        )  # fmt: skip
        program = strategy.worker
        ctx = WorkerContext(rank, n, replica, config, state.should_stop, servers, point or 0)
    else:
        state, program = None, strategy.server
        restored = saved["shard"] if saved is not None else None
        ctx = ServerContext(rank, rank - n, servers, list(range(n)), replica, config, restored, runtime.on_update)
    runtime.state = state
    if saved is not None:
        runtime.restore(saved)
        if log is not None:
            log.resume(state.resumed[1])
    runtime.barrier()  # start the clocks together
    if state is not None:
        runtime.clock.begin(state.resumed[1], state.resumed_wall)
    else:
        runtime.clock.begin()
    facts = runtime.run(program, ctx, state)
    runtime.clock.stop()
    final = replica.params if strategy.decentralised and state is not None else None
    reports, finals = runtime.finish(facts, final)
    runtime.close()
    summary = None
    if rank == 0:
        lost = sorted(runtime.mailbox.lost)
        summary = _report(job, data, state, reports, finals, facts, lost, run_dir, resumed=point)
    return WorkerResult(rank, replica.params.cpu().clone(), facts, summary), bool(runtime.mailbox.lost)


def _run_dir(job: Job, data, rank: int, store: dist.Store, runtime: DistributedRuntime, identity: dict):
    """(run directory, step of the checkpoint to resume from or None), the same on every rank.

    Rank 0 decides: `config.resume`'s latest complete checkpoint; under a `torchrun` restart,
    the first attempt's run directory (found in the agent's store) and its latest complete
    checkpoint, if any; else a new run directory. The others learn the directory from the
    store (when they need it: checkpoints or a resume) and the step by broadcast."""
    config = job.config
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    key = "ako/run_dir"
    if rank == 0:
        if config.resume is not None:
            run_dir, point = Path(config.resume), checkpoint.find(config.resume, identity, config.workers)
        elif attempt > 0 and store.check([key]):
            run_dir = Path(store.get(key).decode())
            point = checkpoint.latest(run_dir, identity["world"])
        else:
            run_dir, point = _open_run_dir(config, job.strategy.name, data), None
        if point is not None:  # checkpoints after `point` belong to the abandoned run: drop them
            checkpoint.drop_after(run_dir, point)
            write_atomic(run_dir / "config.toml", to_toml(replace(config, resume=None)))
            print(f"ako: resuming {run_dir} from its checkpoint at step {point}", file=sys.stderr, flush=True)
        store.set(key, str(run_dir))
    found = runtime.broadcast(torch.tensor([-1 if rank != 0 or point is None else point]))
    point = None if found.item() < 0 else int(found.item())
    if rank != 0:
        run_dir = Path(store.get(key).decode()) if point is not None or config.checkpoint_every else None
    return run_dir, point


def _open_run_dir(config, strategy: str, data) -> Path:
    run_dir = create_run_dir(config.out_dir, strategy)
    write_atomic(run_dir / "config.toml", to_toml(config))
    if data.notice:
        print(f"ako: {data.notice}", file=sys.stderr)
    return run_dir


def final_model(state: WorkerState, unflushed: torch.Tensor, final: dict, test_set) -> dict:
    """Which model the run hands back: the replicas after the flush (rank 0's `final` record),
    or rank 0's replica before it, `unflushed` (numel,), when that one tests better (a flush
    that averages replicas which drifted apart can make the model worse: it is reported)."""
    loss, accuracy = state.replica.evaluate_params(unflushed.to(state.replica.params.device), test_set)
    flushed, accuracy = final["test_accuracy"], round(accuracy, 5)
    worse = accuracy > flushed  # a tie keeps the flushed replicas
    return {
        "source": "rank 0's replica before the flush" if worse else "the replicas after the flush",
        "test_accuracy": round(max(accuracy, flushed), 5),
        "flushed_accuracy": flushed,
        "unflushed_accuracy": accuracy,
        "unflushed_loss": round(loss, 5),
    }


def _report(
    job: Job, data, state: WorkerState, reports: list[dict], finals, facts: dict, lost: list[int], run_dir: Path,
    resumed: int | None = None,
) -> dict:  # fmt: skip
    """Rank 0, after training: evaluate, write summary.json, print the summary. `finals`: the
    live workers' final replicas (decentralised strategies), in the order of their reports;
    their average is weighted by each worker's `average_weight` fact when it has one. `facts`:
    rank 0's program's; its `centre` is the model a strategy with a centre variable reports, and
    its `unflushed` rank 0's replica before a final flush (Ako), each (numel,) when present. `resumed`: the step of the checkpoint the run resumed from, if any."""
    end = {}
    if finals:
        weights = [float(r.get("average_weight", 1.0)) for r in reports if r["role"] == "worker"]
        end = state.consensus_record(finals, weights)
    final = state.finish(end)
    average_eval = (final["average_loss"], final["average_accuracy"]) if finals else None
    summary = build_summary(
        job.strategy.name, job.config, data.name, reports, state.log.records, final,
        average_eval, state.clock.now(), state.clock.wall(),
    )  # fmt: skip
    if job.strategy.summarise is not None:
        summary.update(job.strategy.summarise(reports))
    if facts.get("centre") is not None:
        loss, accuracy = state.replica.evaluate_params(facts["centre"].to(state.replica.params.device), data.test)
        summary["centre_accuracy"], summary["centre_loss"] = round(accuracy, 5), round(loss, 5)
    if facts.get("unflushed") is not None:
        summary["final_model"] = final_model(state, facts["unflushed"], final, data.test)
    summary["lost_ranks"] = lost
    summary["resumed_from_step"] = resumed
    summary["run_dir"] = str(run_dir)
    write_summary(run_dir, summary)
    try:
        print(format_summary(summary), flush=True)
    except BrokenPipeError:  # stdout was closed (piped into head?): summary.json has it all
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return summary
