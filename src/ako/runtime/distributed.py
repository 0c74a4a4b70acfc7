"""The distributed runtime: one worker process on torch.distributed (Gloo on CPU, NCCL on GPU).

`run_worker` is what every worker process runs, whether started by `ako.runtime.launcher` on
one machine or by `torchrun` across machines: it joins the process group from the environment
torch's elastic agent sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), builds the replica and
carries out the strategy program's operations (`DistributedRuntime.run`).
"""

from __future__ import annotations

import ctypes
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ako.config import to_toml
from ako.data import fetch
from ako.metrics import MetricsLog, build_summary, create_run_dir, format_summary, write_atomic, write_summary
from ako.runtime.job import Job
from ako.runtime.mailbox import PROBE, STOP, Mailbox, comm_error
from ako.runtime.worker import Clock, WorkerState
from ako.strategies import WorkerContext
from ako.strategies.ops import (
    AllReduce,
    Compute,
    Gradient,
    MeasureBandwidth,
    MeasureStep,
    Now,
    Poll,
    Recv,
    Send,
)

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
_PROBE_BYTES = 4 << 20


def join_process_group(timeout: float, backend: str) -> tuple[int, int]:
    """Join the job's process group from the elastic agent's environment; returns (rank, world).

    Each restart attempt uses its own key prefix in the agent's store: Gloo would otherwise
    read the previous attempt's stale addresses (engine-facts.md, torchrun --max-restarts).
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=timedelta(seconds=timeout),
    )
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"ako/attempt{attempt}", store),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout),
    )
    return rank, world


class DistributedRuntime:
    """Carries out a strategy program's operations for this worker process.

    `timeout` bounds every wait (seconds). The mailbox runs on a process group of its own.
    """

    def __init__(self, rank: int, world_size: int, timeout: float, device: torch.device):
        self.rank, self.world_size, self.timeout, self.device = rank, world_size, timeout, device
        self.collective_bytes = 0  # as a ring all-reduce moves them: 2 (n-1)/n x bytes each way
        self.state: WorkerState | None = None
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        peers = [r for r in range(world_size) if r != rank]
        self.mailbox = Mailbox(rank, peers, group, timeout, on_stop=self._stop_requested)

    def _stop_requested(self) -> None:
        if self.state is not None:
            self.state.stop_requested = True

    def request_stop(self) -> None:
        """Tell every peer to stop (rank 0 reached the target accuracy)."""
        for peer in self.mailbox.peers:
            self.mailbox.send(torch.empty(0), peer, STOP)

    def bytes_moved(self) -> tuple[int, int]:
        """(sent, received) bytes so far, payloads plus collectives."""
        c = self.collective_bytes
        return self.mailbox.bytes_sent + c, self.mailbox.bytes_received + c

    def run(self, program, ctx, state: WorkerState) -> dict:
        """Drive the generator `program(ctx)` to its end; returns what it returns."""
        self.state = state
        gen = program(ctx)
        result = None
        while True:
            try:
                op = gen.send(result)
            except StopIteration as done:
                return done.value or {}
            result = self.execute(op)

    def execute(self, op):
        """Carry out one operation of `ako.strategies.ops` and return its result."""
        match op:
            case Compute():
                x, y = self.state.next_batch()
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                loss = self.state.replica.compute_gradient(x, y)
                self.state.computed(loss)
                return Gradient(self.state.replica.grad, loss, len(y))
            case Send(tensor, dst, tag, step, aux):
                self.mailbox.send(tensor.cpu(), dst, tag, step, aux)
                return None
            case Recv(tag, src):
                return self._to_device(self.mailbox.get(tag, src, self.timeout))
            case Poll(tag):
                return [self._to_device(m) for m in self.mailbox.poll(tag)]
            case AllReduce(tensor, reduce):
                return self.all_reduce(tensor, reduce)
            case Now():
                return self.state.clock.now()
            case MeasureStep():
                return self.measure_step()
            case MeasureBandwidth():
                return self.measure_bandwidth()
        raise TypeError(f"unknown operation {op!r}")

    def _to_device(self, message):
        if message.tensor.device == self.device:
            return message
        return replace(message, tensor=message.tensor.to(self.device))

    def all_reduce(self, tensor: torch.Tensor, reduce: str = "sum", count: bool = True) -> torch.Tensor:
        """In-place all-reduce with a deadline of `timeout` seconds; `count` adds its bytes to
        the traffic counters (not for the runtime's own barriers)."""
        try:
            work = dist.all_reduce(tensor, op=_REDUCE_OPS[reduce], async_op=True)
            work.wait(timedelta(seconds=self.timeout))
        except RuntimeError as e:
            raise RuntimeError(f"all-reduce failed, a worker is gone or stuck: {comm_error(e)}") from None
        if count:
            n = self.world_size
            self.collective_bytes += 2 * (n - 1) * tensor.numel() * tensor.element_size() // n
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

    def gather_counts(self, state: WorkerState) -> list[dict]:
        """Every worker's steps, samples and bytes sent and received, by rank."""
        sent, received = self.bytes_moved()
        counts = torch.tensor([state.step, state.samples, sent, received], dtype=torch.float64)
        every = [torch.empty_like(counts) for _ in range(self.world_size)]
        dist.all_gather(every, counts, async_op=True).wait(timedelta(seconds=self.timeout))
        keys = ("steps", "samples", "bytes_sent", "bytes_received")
        return [{"rank": r, **{k: int(v) for k, v in zip(keys, c.tolist())}} for r, c in enumerate(every)]

    def average(self, params: torch.Tensor) -> torch.Tensor:
        """The mean of every worker's `params` (not counted as training traffic)."""
        return self.all_reduce(params.clone(), count=False).div_(self.world_size)

    def close(self) -> None:
        """Say goodbye to every peer and wait for theirs (at most `timeout` seconds)."""
        self.mailbox.close(self.timeout)


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
    """Train as one worker of the job whose group the elastic agent's environment describes."""
    torch.set_num_threads(1)  # one thread per worker process: more oversubscribes the cores
    config = job.config
    backend, device = pick_device(config.backend)
    try:
        rank, world = join_process_group(config.timeout, backend)
    except (RuntimeError, dist.DistError) as e:
        raise RuntimeError(f"the workers did not all join within {config.timeout:g} s: {comm_error(e)}") from None
    name_process(f"ako-rank{rank}")
    result = _train(replace(job, config=replace(config, workers=world)), rank, world, device)
    # Only after success: on failure a receive thread may be blocked on a stuck peer, and
    # destroying the group under it could wait for ever; the process exits instead.
    dist.destroy_process_group()
    return result


def _train(job: Job, rank: int, world: int, device: torch.device) -> WorkerResult:
    data = job.load_data()
    # what the run really used: the data set `auto` chose, the user's own model or data
    model = "custom" if job.model_fn is not None else job.config.model
    job = replace(job, config=replace(job.config, dataset=data.name, model=model))
    config, strategy = job.config, job.strategy
    replica = job.build_replica(data, device)
    job.validate(data, replica.numel)
    try:
        runtime = DistributedRuntime(rank, world, config.timeout, device)
        runtime.broadcast(replica.params)  # identical replicas, whatever the model factory did
    except (RuntimeError, dist.DistError) as e:
        raise RuntimeError(f"the workers did not all get ready within {config.timeout:g} s: {comm_error(e)}") from None
    run_dir = _open_run_dir(config, strategy.name, data) if rank == 0 else None
    log = MetricsLog(run_dir / "metrics.jsonl") if run_dir else None
    clock = Clock()
    state = WorkerState(
        config, rank, world, data.train, data.test, replica, clock, log, runtime.bytes_moved, runtime.request_stop
    )
    runtime.barrier()  # start the clocks together
    clock.begin()
    facts = runtime.run(strategy.worker, WorkerContext(rank, world, replica, config, state.should_stop), state)
    clock.stop()
    runtime.close()
    per_worker = runtime.gather_counts(state)
    average = runtime.average(replica.params) if strategy.decentralised else None
    summary = None
    if rank == 0:
        summary = _report(job, data, state, facts, per_worker, average, run_dir)
    return WorkerResult(rank, replica.params.cpu().clone(), facts, summary)


def _open_run_dir(config, strategy: str, data) -> Path:
    run_dir = create_run_dir(config.out_dir, strategy)
    write_atomic(run_dir / "config.toml", to_toml(config))
    if data.notice:
        print(f"ako: {data.notice}", file=sys.stderr)
    return run_dir


def _report(job: Job, data, state: WorkerState, facts: dict, per_worker, average, run_dir: Path) -> dict:
    """Rank 0, after training: evaluate, write summary.json, print the summary."""
    final = state.finish()
    average_eval = None if average is None else state.replica.evaluate_params(average, data.test)
    summary = build_summary(
        job.strategy.name, job.config, state.world_size, data.name, facts, state.log.records, final,
        average_eval, per_worker, state.clock.now(), state.clock.wall(),
    )  # fmt: skip
    summary["run_dir"] = str(run_dir)
    write_summary(run_dir, summary)
    try:
        print(format_summary(summary), flush=True)
    except BrokenPipeError:  # stdout was closed (piped into head?): summary.json has it all
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return summary
