"""Start the processes of a job on this machine, as torchrun would, and watch them: a failed
process becomes one line naming its rank and exit status, and a process that dies ends the job
unless the strategy carries on without it. (torch's own elastic agent stops every process
when one fails, so it cannot run a job that survives the loss of a worker.)"""

from __future__ import annotations

import math
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import multiprocessing.reduction as mp_reduction
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from datetime import timedelta
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from ako.config import ConfigError
from ako.data import DataError
from ako.run.outcome import WorkerResult
from ako.runtime.distributed import forkserver, quiet
from ako.runtime.distributed.liveness import all_stopped, has_started, is_stopped, record_cause
from ako.runtime.distributed.mailbox import comm_error
from ako.runtime.distributed.process import END, RUN_DIR_KEY, JobEnded, run_rank
from ako.run.job import Job
from ako.strategies.ops import PeerLost

# Failures a worker reports in one line; anything else is a bug and keeps its traceback.
EXPECTED_FAILURES = (PeerLost, TimeoutError, DataError, ConfigError, dist.DistError, RuntimeError, OSError, JobEnded)
_GRACE = 5.0  # seconds rank 0 may take to log its metrics after a fatal loss


class WorkerFailed(RuntimeError):
    """A worker process failed; the message names its rank and exit status."""


def under_elastic_agent() -> bool:
    """True inside a process started by torchrun (or torch's elastic agent)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


@dataclass(frozen=True)
class RankFailed:
    """What a launched process hands back instead of a result when it fails as expected: its
    one line. The launcher reports the failure that ended the job, or each lost worker, once;
    lines of ranks that only met another's failure are left out."""

    line: str


_RESULTS = None  # a launched process's pipe to the launcher (set by `_child`)


def rank_entry(job: Job) -> WorkerResult:
    """The function each launched process runs: its result; on an expected failure the
    launcher gets RankFailed through the result pipe and the process exits with status 1
    (set AKO_DEBUG=1 for the traceback)."""
    try:
        return _numpy(run_rank(job))
    except EXPECTED_FAILURES as e:
        if os.environ.get("AKO_DEBUG"):
            raise
        # Often this worker only noticed another's death: give the launcher a moment to see
        # that one first, so that its report names the root cause.
        time.sleep(1.0)
        failure = RankFailed(one_line(e))
        if _RESULTS is None:  # not launched by `launch_function`
            print(f"ako: rank {os.environ.get('RANK', '?')}: {failure.line}", file=sys.stderr)
        else:
            _RESULTS.send(failure)
            _RESULTS.close()
        # Exit from inside the except: unwinding would free the failed run's objects (a stuck
        # DataLoader's processes, Gloo's threads), which can wait for ever.
        _exit_now(1)


def _numpy(result: WorkerResult) -> WorkerResult:
    """Tensors travel to the launcher as NumPy arrays, by value: torch would share their memory
    through file descriptors, which are gone if the worker dies before the launcher reads them."""
    return _convert(result, torch.Tensor, torch.Tensor.numpy)


def _torch(result: WorkerResult) -> WorkerResult:
    return _convert(result, np.ndarray, torch.from_numpy)


def _convert(result: WorkerResult, kind: type, convert) -> WorkerResult:
    def one(value):
        if isinstance(value, kind):
            return convert(value)
        if isinstance(value, (list, tuple)):
            return type(value)(one(v) for v in value)
        if isinstance(value, dict):
            return {k: one(v) for k, v in value.items()}
        return value

    return replace(result, params=one(result.params), facts=one(result.facts), model=one(result.model))


def _exit_now(status: int) -> None:
    """Exit without interpreter teardown: receive threads may still be blocked in a Gloo recv
    from a dead peer, and tearing down under them aborts the process."""
    if sys.stdout is not None:  # None when the launcher's stdout was closed
        sys.stdout.flush()
    quiet.drain()
    os._exit(status)


def launch(job: Job, processes: int) -> dict[int, WorkerResult]:
    """Run `job` on `processes` local processes (workers, then servers); returns each surviving
    rank's result. Raises WorkerFailed when a worker fails, unless the strategy survives the
    loss of a worker other than rank 0 (the others then carry on; rank 0 reports the loss)."""
    workers = job.config.workers
    survivable = range(1, workers) if job.strategy.survives(job.config) else ()
    results = launch_function(
        rank_entry, processes, job, timeout=job.config.timeout, survivable=survivable,
        role=lambda rank: "worker" if rank < workers else "server",
    )  # fmt: skip
    return {rank: _torch(result) for rank, result in results.items()}


def launch_function(fn, processes: int, *args, timeout: float = 60.0, survivable=(), role=lambda rank: "worker") -> dict:
    """Run `fn(*args)` in `processes` new processes, as torchrun would start them (RANK,
    LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set, one thread each); returns {rank:
    fn's result} for every process that succeeded. `fn` must be importable (each process
    unpickles it). They are forked by a fork server that has loaded torch and ako once
    (`preload`), and take this process's environment and stdout/stderr, as spawned ones would.

    The launcher hosts the job's TCPStore and watches its processes: when one fails, the others
    are killed and WorkerFailed names the rank, unless the rank
    is in `survivable`; `role(rank)` names the process in messages. Ctrl-C or SIGTERM stops them
    all, rank 0 after it has logged the metrics it has (up to `_GRACE` s), and raises
    KeyboardInterrupt, its `run_dir` the run directory (None if rank 0 had made none); unless rank 0 was past training and hands in its result meanwhile, which
    is then returned. `timeout` bounds start-up (seconds)."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout), wait_for_workers=False)
    env = {
        **os.environ,  # as the caller has it now: a forked process has the fork server's
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "WORLD_SIZE": str(processes),
        "LOCAL_WORLD_SIZE": str(processes),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "FATAL"),  # ako reports failures itself (ako/__init__.py)
    }
    context = forkserver.context()
    forkserver.start()  # if not yet (`ako train` starts it first thing)
    group = _Group()
    with terminate_on_sigterm():
        try:
            for rank in range(processes):
                group.start(context, fn, args, rank, {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)})
            return group.watch(set(survivable), role, timeout, started=lambda: has_started(store),
                               survived=partial(record_cause, store))
        except KeyboardInterrupt as interrupt:
            try:
                handed_in = group.interrupted()
            except KeyboardInterrupt:  # a second one stops the wait, but rank 0 may have handed in by now
                handed_in = group.handed_in()
            if handed_in:  # rank 0 was writing the summary: the run is whole, and so is its outcome
                return group.results
            interrupt.run_dir = _run_dir_of(store)  # for the line that ends the command
            raise
        finally:
            group.stop()
            del store


def _run_dir_of(store: dist.Store) -> str | None:
    """The run directory rank 0 has put in the job's `store`, if it has."""
    try:
        return store.get(RUN_DIR_KEY).decode() if store.check([RUN_DIR_KEY]) else None
    except (RuntimeError, UnicodeDecodeError):  # the store's own errors (DistStoreError is a RuntimeError)
        return None


class _Group:
    """The launched processes, their result pipes, what became of each, and their lifeline
    (`_die_with_launcher`: its write end is open as long as this process lives, or `stop`)."""

    def __init__(self):
        self.procs: dict[int, mp.Process] = {}
        self.pipes: dict[int, object] = {}
        self.results: dict[int, object] = {}
        self.failures: dict[int, RankFailed] = {}
        self.lifeline = os.pipe()

    def start(self, context, fn, args, rank: int, env: dict) -> None:
        receiver, sender = context.Pipe(duplex=False)
        proc = context.Process(target=_child, args=(fn, args, env, _Inherited(self.lifeline[0]), sender), name=f"ako-rank{rank}")
        spawned = context.get_start_method() == "spawn"
        with _sigint_ignored() if spawned else nullcontext():  # inherited: Ctrl-C while it imports torch stays quiet
            proc.start()
        sender.close()
        self.procs[rank], self.pipes[rank] = proc, receiver

    def watch(self, survivable: set[int], role, timeout: float, started, survived) -> dict:
        """Collect results until every process has ended; raise WorkerFailed on a failure that
        ends the job: any before `started()` (the others would wait out the start-up timeout
        for it), after that one of a rank not in `survivable`; a loss the job survives goes to
        `survived(rank, how)` (for the summary). Once rank 0 has handed in its
        result (the run is over), a process that has not ended `timeout` seconds later is
        stopped or hung: it is lost."""
        lost: dict[int, str] = {}
        running = set(self.procs)
        deadline = alone = math.inf
        while running:
            if 0 in self.results and deadline == math.inf:
                deadline = time.monotonic() + timeout
            if time.monotonic() > deadline or (deadline < math.inf and all_stopped(self.procs[r].pid for r in running)):
                self._give_up(running, survivable, role, timeout)
                break
            alone = self._alone_and_stopped(running, alone, timeout, role)
            waitables = [self.procs[r].sentinel for r in running] + [self.pipes[r] for r in running if r not in self.results]
            mp_connection.wait(waitables, timeout=1.0)
            for rank in sorted(running):
                self._read(rank)
                code = self.procs[rank].exitcode
                if code is None:
                    continue
                running.discard(rank)
                if rank in self.results:  # it finished its part: dying in teardown fails nothing
                    continue
                failure = self.failures.get(rank)
                lost[rank] = failure.line if failure else _exit_status(code) if code else "exited without a result"
                # a rank the job cannot lose (rank 0, a server) is stopped: that is why this one failed
                vital_stopped = any(is_stopped(self.procs[r].pid) for r in running - survivable)
                begun = started()
                if rank in survivable and begun and not vital_stopped:
                    print(f"ako: {role(rank)} rank {rank} lost: {lost[rank]}", file=sys.stderr, flush=True)
                    survived(rank, lost[rank])
                else:
                    stopped = next((r for r in sorted(running) if is_stopped(self.procs[r].pid)), None)
                    if begun:  # rank 0 has metrics to log
                        self._wind_up(running)
                    then = f" ({role(rank)} rank {rank}: {lost[rank]})"  # what the cause did to the job
                    if stopped is not None:  # the cause, rather than the rank that timed out on it
                        raise WorkerFailed(f"{role(stopped)} rank {stopped} failed: stopped (SIGSTOP or a debugger); "
                                           f"the others timed out waiting for it{then}")  # fmt: skip
                    first = min((r for r in lost if r != rank), default=None)
                    if first is not None:  # a loss the strategy could not survive after all (Ako's ring)
                        raise WorkerFailed(f"{role(first)} rank {first} failed: {lost[first]}; the others could not go on without it{then}")
                    raise WorkerFailed(f"{role(rank)} rank {rank} failed: {lost[rank]}{'' if begun or failure else ' before training began'}")
        return self.results

    def _alone_and_stopped(self, running: set[int], since: float, timeout: float, role) -> float:
        """Raise WorkerFailed when rank 0, which evaluates and reports, is the last process
        left and has been stopped for `timeout` s (the others ended without it: nothing would
        end the job); returns since when it has been so (inf: it is not)."""
        if running != {0} or 0 in self.results or not is_stopped(self.procs[0].pid):
            return math.inf
        now = time.monotonic()
        if now - min(since, now) > timeout:
            raise WorkerFailed(f"{role(0)} rank 0 failed: stopped (SIGSTOP or a debugger) for {timeout:g} s; the others ended without it")
        return min(since, now)

    def interrupted(self) -> bool:
        """Ctrl-C: rank 0 logs the metrics it has first (`_wind_up`; a second Ctrl-C stops it
        at once), and a line says so at once. Returns whether it handed in its result meanwhile
        (it was past training)."""
        if self.procs[0].exitcode is None and 0 not in self.results and 0 not in self.failures:
            print(f"{chr(10) if sys.stderr.isatty() else ''}ako: stopping: rank 0 logs the evaluations it has first "
                  f"(up to {_GRACE:g} s; Ctrl-C again stops it at once)", file=sys.stderr, flush=True)  # fmt: skip
        self._wind_up({rank for rank, proc in self.procs.items() if proc.exitcode is None})
        return self.handed_in()

    def handed_in(self) -> bool:
        """Whether rank 0 has handed in its result (read what the pipes hold first)."""
        for rank in self.procs:
            self._read(rank)
        return 0 in self.results

    def _wind_up(self, running: set[int]) -> None:
        """The job failed or was interrupted: give rank 0, if still training, up to `_GRACE` s
        to log the metrics it has. It is told (`END`, which raises JobEnded in it), and let run first if it is
        stopped: under a strategy that goes on without a dead worker as far as rank 0 can tell
        (ssp's server drops it), it would not meet the failure itself."""
        if 0 not in running or 0 in self.results or 0 in self.failures:
            return
        pid = self.procs[0].pid
        try:
            if is_stopped(pid):
                os.kill(pid, signal.SIGCONT)
            os.kill(pid, END)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + _GRACE
        while self.procs[0].exitcode is None and (left := deadline - time.monotonic()) > 0:
            # read as it waits: a result larger than the pipe's buffer would hold rank 0 in its send
            handed_in = 0 in self.results or 0 in self.failures
            mp_connection.wait([self.procs[0].sentinel] + ([] if handed_in else [self.pipes[0]]), timeout=left)
            self._read(0)

    def _give_up(self, running: set[int], survivable: set[int], role, timeout: float) -> None:
        """Rank 0 is done and these have not ended within `timeout`, or are all stopped: fail on
        the first that had no result and is not survivable (the rest are lost, and stopped by
        `stop`)."""
        for rank in sorted(running - set(self.results)):
            if rank not in survivable:
                raise WorkerFailed(f"{role(rank)} rank {rank} failed: did not end within {timeout:g} s of rank 0 (stopped or hung)")

    def _read(self, rank: int) -> None:
        pipe = self.pipes[rank]
        if rank not in self.results and rank not in self.failures and pipe.poll():
            try:
                result = pipe.recv()
            except (EOFError, OSError):  # it died before sending or while, or a Ctrl-C cut the last receipt short
                return
            if isinstance(result, RankFailed):
                self.failures[rank] = result
            else:
                self.results[rank] = result

    def stop(self) -> None:
        """Kill every process still running: the job is over (run outputs are written
        atomically, so nothing is left half-written)."""
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
        for proc in self.procs.values():
            proc.join(_GRACE)  # bounded: only the fork server can tell that a process ended
        for fd in self.lifeline:
            os.close(fd)


class _Inherited:
    """What a launched process takes from its launcher as a spawned one would inherit it:
    stdout and stderr as they are at the launch (not the fork server's: a test's captured
    output, a redirection since), and `lifeline`, the read end of a pipe whose write end only
    the launcher holds. Unpickled in the process, it is the lifeline's descriptor there."""

    def __init__(self, lifeline: int):
        self.lifeline = lifeline

    def __reduce__(self):
        stdio = [mp_reduction.DupFd(_stdio_fd(stream, fd)) for stream, fd in ((sys.stdout, 1), (sys.stderr, 2))]
        return _adopt, (*stdio, mp_reduction.DupFd(self.lifeline))


_devnull: int | None = None


def _stdio_fd(stream, fd: int) -> int:
    """`fd` (1 or 2), or /dev/null's when this process started without it (`stream`, Python's
    stdout or stderr, is then None): another file has its number by now (an epoll's), which
    is no place to print."""
    global _devnull
    try:
        if stream is not None and os.fstat(fd):
            return fd
    except OSError:
        pass
    if _devnull is None:
        _devnull = os.open(os.devnull, os.O_WRONLY)
    return _devnull


def _adopt(stdout, stderr, lifeline) -> int:
    sources = [stdout.detach(), stderr.detach()]  # one descriptor, when both are /dev/null
    for target, source in zip((1, 2), sources):
        os.dup2(source, target)
    for source in set(sources) - {1, 2}:
        os.close(source)
    for name, fd in (("stdout", 1), ("stderr", 2)):  # None where the fork server began without it
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, "w", buffering=1, closefd=False))
    return lifeline.detach()


def _die_with_launcher(lifeline: int) -> None:
    """A launched process's thread: reading the lifeline ends only when no process holds its
    write end, that is when the launcher has died; then this process dies too (SIGKILL, as a
    parent-death signal would: the process's parent is the fork server, which lives on)."""
    while os.read(lifeline, 1):  # nothing is ever written
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def _child(fn, args, env: dict, lifeline: int, pipe) -> None:
    """A launched process: die with the launcher (`lifeline`, from `_Inherited`, which has
    made stdout and stderr the launcher's), leave Ctrl-C to it (it stops every process at once,
    and only it reports), take the launcher's environment, run, send the result."""
    threading.Thread(target=_die_with_launcher, args=(lifeline,), name="ako-lifeline", daemon=True).start()
    # Processes of its own (a DataLoader's) are spawned: a fork server of its own would live
    # as long as its loader processes, which die only with it.
    mp.set_start_method("spawn", force=True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(END, _end_now)  # while training it has rank 0 log its metrics first (`process._endable`)
    # SIGTERM to the whole group (`timeout`, a scheduler) ends rank 0 as the launcher does, the others at once
    signal.signal(signal.SIGTERM, _as_end if env["RANK"] == "0" else signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    global _RESULTS
    _RESULTS = pipe
    result = fn(*args)
    pipe.send(result)
    pipe.close()
    _exit_now(0)  # no teardown: see `_exit_now`


def _as_end(signum, frame):
    """SIGTERM in rank 0: what `END` does now (log the metrics so far while training)."""
    os.kill(os.getpid(), END)


def _end_now(signum, frame):
    """`END` outside training: the launcher is ending the job, and there is nothing to log."""
    _exit_now(1)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@contextmanager
def _sigint_ignored():
    """SIGINT ignored in this block (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def terminate_on_sigterm():
    """In this block SIGTERM raises KeyboardInterrupt, as Ctrl-C does: the launcher stops its
    workers, the CLI every command (only the main thread may set signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_status(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def one_line(e: BaseException) -> str:
    """The first line of an error's message, at most 300 characters (a communication
    error's without Gloo's source location and advice)."""
    if str(e).startswith("["):  # Gloo's "[.../pair.cc:553] Connection closed by peer ..."
        return comm_error(e)
    lines = str(e).strip().splitlines()
    return (lines[0] if lines else type(e).__name__)[:300]
