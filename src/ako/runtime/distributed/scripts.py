"""`ako run`: start a user's own training script as the processes of one job, as torchrun
would, and watch them as ako's launcher watches `ako train`'s.

Each process runs `python SCRIPT ARGS` with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set (the job's TCPStore is hosted here), one thread each, and the run's settings
in SETTINGS_ENV for its `ako.wrap`. Ranks from `workers` on are the parameter
servers (easgd, ssp, asp): the same script, whose `wrap` runs the server instead of returning.

A process that fails is named in one line: its own line (a worker's failure goes to the store,
FAILED_KEY), or how it ended. Where the strategy goes on without a worker (Ako on
all-to-all, gossip, easgd, asp) the loss of one other than rank 0 once training has begun is
reported and the others carry on; otherwise the others are stopped and the run fails. A
process stopped (SIGSTOP) is dropped by the others after the timeout; once rank 0 has
finished, one that has not ended within the timeout is stopped and named. Bad usage in the
script's `wrap` (exit status 2, its line printed by the script) ends the job with status 2.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from ako.runtime.distributed.launcher import _exit_status
from ako.runtime.distributed.liveness import all_stopped, is_stopped

SETTINGS_ENV = "AKO_LOOP"  # the run's settings, JSON, for the script's `ako.wrap` (they override its keywords)
LAUNCHER_ENV = "AKO_RUN"  # set for the scripts: a failure goes to the store, and the launcher prints it
FAILED_KEY = "ako/loop/failed/"  # + rank: a process's one-line failure
SURVIVES_KEY = "ako/loop/survives"  # once training has begun: "1" where the run goes on without a lost worker
EXIT_FAILED, EXIT_BAD_USAGE, EXIT_INTERRUPTED = 1, 2, 130
_POLL = 0.1  # seconds between looks at the processes
_USAGE_GRACE = 5.0  # seconds the other ranks get to end after one reported bad usage (rank 0 prints it)
_PR_SET_PDEATHSIG = 1


def run_script(script: str, args: list[str], workers: int, servers: int, settings_json: str, timeout: float) -> int:
    """Run `script` with `args` on `workers` + `servers` processes; returns the exit status:
    0 (rank 0 finished; lost workers were reported), 1 (a process failed and the job could not go
    on), 2 (bad usage), 130 (Ctrl-C or SIGTERM). `settings_json` goes to every process's
    environment (SETTINGS_ENV)."""
    processes = workers + servers
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout), wait_for_workers=False)
    env = {
        **os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": str(processes),
        "LOCAL_WORLD_SIZE": str(processes), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "FATAL"), SETTINGS_ENV: settings_json,
        LAUNCHER_ENV: "1",
    }  # fmt: skip
    procs: dict[int, subprocess.Popen] = {}
    watch = _Watch(procs, workers, store, timeout)
    try:
        for rank in range(processes):
            procs[rank] = subprocess.Popen(
                [sys.executable, script, *args], env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                preexec_fn=_die_with_parent, start_new_session=True,  # Ctrl-C is the launcher's to act on
            )  # fmt: skip
        return watch.run()
    except KeyboardInterrupt:
        print(f"{chr(10) if sys.stderr.isatty() else ''}ako run: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    finally:
        _stop(procs)
        del store


def _die_with_parent() -> None:
    """In the child before it runs the script: SIGKILL when the launcher dies."""
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _stop(procs: dict[int, subprocess.Popen]) -> None:
    """Kill every process still running (a stopped one too: SIGKILL needs no SIGCONT)."""
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
    for proc in procs.values():
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


class _Watch:
    """What became of each process, and the one line for each failure."""

    def __init__(self, procs, workers: int, store, timeout: float):
        self.procs, self.workers, self.store, self.timeout = procs, workers, store, timeout

    def role(self, rank: int) -> str:
        return "worker" if rank < self.workers else "server"

    def _said(self, rank: int) -> bool:
        try:
            return self.store.check([f"{FAILED_KEY}{rank}"])
        except RuntimeError:
            return False

    def line(self, rank: int, code: int) -> str:
        """The process's own line (from the store), else how it ended."""
        key = f"{FAILED_KEY}{rank}"
        try:
            if self.store.check([key]):
                return self.store.get(key).decode()
        except RuntimeError:
            pass
        return _exit_status(code) if code else "exited without finishing"

    def survives(self, rank: int) -> bool:
        """Whether the job goes on without `rank`: a worker other than rank 0 in a run that
        survives a loss (Ako on the ring does not), as rank 0 puts it in the store at its first
        step (after the start-up and the strategy's plan). Before that no loss is survived: the
        others would wait out the start-up timeout for the lost one."""
        return 0 < rank < self.workers and self._stored(SURVIVES_KEY) == "1"

    def _stored(self, key: str) -> str | None:
        try:
            return self.store.get(key).decode() if self.store.check([key]) else None
        except RuntimeError:
            return None

    def run(self) -> int:
        running = set(self.procs)
        deadline = None  # once rank 0 has finished: when the others must have ended
        usage_since, usage = None, set()
        while running:
            time.sleep(_POLL)
            ended = [rank for rank in sorted(running) if self.procs[rank].poll() is not None]
            # a rank that died without a word first: the others' lines are mostly that death, met
            ended.sort(key=lambda rank: self._said(rank))
            for rank in ended:
                code = self.procs[rank].returncode
                running.discard(rank)
                if code == 0:
                    if rank == 0:
                        deadline = time.monotonic() + self.timeout
                    continue
                if code == EXIT_BAD_USAGE:
                    usage_since = usage_since or time.monotonic()
                    usage.add(rank)
                    continue
                line = self.line(rank, code)
                if self.survives(rank) and not self._vital_stopped(running):
                    print(f"ako run: {self.role(rank)} rank {rank} lost: {line}; the others go on without it",
                          file=sys.stderr, flush=True)  # fmt: skip
                    continue
                stopped = next((r for r in sorted(running) if is_stopped(self.procs[r].pid)), None)
                if stopped is not None:  # the cause, rather than the rank that timed out waiting on it
                    line = (f"{self.role(stopped)} rank {stopped} failed: stopped (SIGSTOP or a debugger); the others "
                            f"timed out waiting for it ({self.role(rank)} rank {rank}: {line})")  # fmt: skip
                else:
                    line = f"{self.role(rank)} rank {rank} failed: {line}"
                print(f"ako run: {line}", file=sys.stderr, flush=True)
                return EXIT_FAILED
            if usage_since is not None and (0 not in running or time.monotonic() - usage_since > _USAGE_GRACE):
                if 0 not in usage:  # rank 0 says why (its line); else the rank that failed does not
                    first = min(usage)
                    print(f"ako run: {self.role(first)} rank {first}: bad usage (exit status 2)", file=sys.stderr, flush=True)
                return EXIT_BAD_USAGE
            if deadline is not None and running and (time.monotonic() > deadline or all_stopped(self.procs[r].pid for r in running)):
                return self._late(running)
        return 0

    def _vital_stopped(self, running: set[int]) -> bool:
        """Rank 0 or a server is stopped: that is why a worker failed, and no one goes on."""
        return any(is_stopped(self.procs[r].pid) for r in running if not (0 < r < self.workers))

    def _late(self, running: set[int]) -> int:
        """Rank 0 finished and these have not ended within `timeout` s (or are all stopped, and
        never would): lost where the strategy went on without them (they were dropped: a
        stopped one was named by the peer that dropped it, so not again here), else the run
        failed."""
        status = 0
        for rank in sorted(running):
            stopped = is_stopped(self.procs[rank].pid)
            how = "stopped (SIGSTOP or a debugger)" if stopped else "stuck"
            if self.survives(rank):
                if not stopped:
                    print(f"ako run: {self.role(rank)} rank {rank} lost: stuck; the others finished without it",
                          file=sys.stderr, flush=True)  # fmt: skip
            else:
                print(f"ako run: {self.role(rank)} rank {rank} failed: {how}, it did not end within "
                      f"{self.timeout:g} s of rank 0", file=sys.stderr, flush=True)  # fmt: skip
                status = EXIT_FAILED
        return status
