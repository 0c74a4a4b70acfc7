"""What the peer arms that find their peers themselves (`peer_hivemind.py`, `peer_torchft.py`)
share: the job's TCPStore (rank 0 hosts it at MASTER_ADDR:MASTER_PORT), for addresses and the
start and end barriers only; a heartbeat per worker in it, by which rank 0 tells a dead worker
from a slow one; the watchdog; the exit that takes the library's helper processes with it; the
command line and the exit codes (0 done; 1 failed; 3 cannot run here, with one line naming the
error); and --check's launcher of local workers.

An arm describes itself in an `Arm` (its name, library, settings and --check values) and keeps
its own start() and run_worker(); every line it prints starts with `peer_<name>:`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, NoReturn

DEAD_AFTER = 10.0  # s: a worker whose heartbeat in the store stopped this long ago is gone
COMMON = ("epochs", "train_samples", "test_samples", "eval_every")  # add_arguments' flags --check sets
ENDING = threading.Event()  # set when this worker starts to leave: the store may go now


class CannotRun(Exception):
    """The arm cannot run here (exit 3)."""


@dataclass
class Arm:
    """One arm: `name` (the result's arm; its lines start with `peer_<name>:`), the `library`
    whose import says whether it can run here, the script's docstring `doc`, its `settings` (a
    flag each: --sync-every for sync_every), `check` (--check's local workers, and its values
    for settings and COMMON flags) and `own_arguments`, which adds the arm's other flags."""

    name: str
    library: str
    doc: str
    settings: dict
    check: dict
    own_arguments: Callable[[argparse.ArgumentParser], None] = lambda parser: None

    @property
    def prefix(self) -> str:
        return f"peer_{self.name}"

    def parse_args(self) -> argparse.Namespace:
        """add_arguments' flags (--out optional: --check's launcher needs none), --check, --timeout,
        a flag for each setting, and the arm's own. A setting or COMMON flag not given takes
        --check's value under --check, else its default."""
        import peer_common

        p = argparse.ArgumentParser(description=self.doc.splitlines()[0])
        peer_common.add_arguments(p)
        for action in p._actions:
            if action.dest == "out":
                action.required, action.default = False, None
        defaults = {**{key: p.get_default(key) for key in COMMON}, **self.settings}
        p.set_defaults(**dict.fromkeys(COMMON))  # None: not given
        p.add_argument("--check", action="store_true", help="2 local workers, a few steps: exit 0 if the loss went down")
        p.add_argument("--timeout", type=float, default=120.0,
                       help="seconds any wait may take: start-up, a stalled step, the end barrier")  # fmt: skip
        for key, value in self.settings.items():
            p.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None, help=f"default {value}")
        self.own_arguments(p)
        args = p.parse_args()
        check = self.check if args.check else {}
        for key, default in defaults.items():
            if getattr(args, key) is None:
                setattr(args, key, check.get(key, default))
        return args

    def main(self, script: str, run_worker: Callable[[argparse.Namespace], int]) -> int:
        """The arm's command line: --check without RANK launches its local workers (of `script`);
        otherwise this process is the worker RANK, run by `run_worker`."""
        launch = "RANK" not in os.environ
        try:
            args = self.parse_args()  # imports peer_common, hence torch and ako
            if args.check and launch:
                importlib.import_module(self.library)  # the quick answer to "can this arm run here"
        except Exception as e:
            print(f"{self.prefix}: cannot run here: import failed: {type(e).__name__}: {e}")
            return 3
        if args.check and launch:
            return launch_check(self.prefix, script, sys.argv[1:], self.check["workers"], 3 * args.timeout)
        if not args.out and not args.check:
            print(f"{self.prefix}: --out is required (rank 0 writes the result there)")
            return 2
        return run_worker(args)


def own_address(master: str) -> str:
    """This host's address on the route to `master` (127.0.0.1 for a local master)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(master), 9))  # UDP: no packet is sent
        return s.getsockname()[0]


def connect_store(host: str, port: int, rank: int, world: int, timeout: float, master: bool | None = None):
    """The job's TCPStore (rank 0 hosts it) within `timeout` s: the constructor's handshake has
    no timeout of its own, so it runs on a daemon thread."""
    from torch.distributed import TCPStore

    result: list = []
    master = rank == 0 if master is None else master

    def connect():
        try:
            result.append(TCPStore(host, port, world, is_master=master, timeout=timedelta(seconds=timeout),
                                   wait_for_workers=False))  # fmt: skip
        except Exception as e:  # handed on below
            result.append(e)

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout + 5)
    if not result:
        raise TimeoutError(f"no answer from the store at {host}:{port} within {timeout + 5:.0f} s")
    if isinstance(result[0], Exception):
        raise result[0]
    return result[0]


def heartbeat(prefix: str, host: str, port: int, rank: int, world: int, timeout: float) -> None:
    """Count `alive/<rank>` up in the store every second, on a thread with its own connection:
    rank 0 tells a dead worker from a slow one by it. If the store goes before this worker
    leaves, rank 0 is gone (and with it the job's result): end at once, with one line."""
    store = connect_store(host, port, rank, world, timeout, master=False)

    def beat():
        try:
            while True:
                store.add(f"alive/{rank}", 1)
                time.sleep(1)
        except Exception as e:
            if not ENDING.is_set():
                hard_exit(1, f"{prefix}: rank {rank}: the job's store at {host}:{port} is gone (did rank 0 end?): {type(e).__name__}")

    threading.Thread(target=beat, daemon=True).start()


def join(prefix: str, rank: int, world: int, timeout: float):
    """(this worker's address on the route to rank 0, the job's store) from torchrun's
    MASTER_ADDR and MASTER_PORT, with this worker's heartbeat running in the store."""
    master, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = connect_store(master, port, rank, world, timeout)
    heartbeat(prefix, master, port, rank, world, timeout)
    return own_address(master), store


def wait_for(store, key: str, world: int, timeout: float, gone_before=()) -> tuple[dict[int, str], list[int]]:
    """Rank 0: wait until every worker has set `key/<rank>` or is gone (its heartbeat stopped
    DEAD_AFTER s ago, or it is in `gone_before`), `timeout` s at most. Returns ({rank: value} of
    those that set it, the ranks that did not)."""
    deadline, found, seen = time.monotonic() + timeout, {}, {}
    while True:
        now, gone = time.monotonic(), []
        for r in range(world):
            if r not in found and store.check([f"{key}/{r}"]):
                found[r] = store.get(f"{key}/{r}").decode()
            if r not in found and r in gone_before:
                gone.append(r)
            elif r not in found:
                beats = store.add(f"alive/{r}", 0)
                if seen.get(r, (None,))[0] != beats:
                    seen[r] = (beats, now)
                elif now - seen[r][1] > DEAD_AFTER:
                    gone.append(r)
        missing = [r for r in range(world) if r not in found]
        if len(gone) == len(missing) or now > deadline:
            return found, missing
        time.sleep(0.1)


def start_together(store, rank: int, world: int, timeout: float) -> None:
    """The start barrier: rank 0 waits for every worker, then says go (or why not, and every
    worker raises CannotRun)."""
    store.set(f"started/{rank}", "1")
    if rank == 0:
        _, missing = wait_for(store, "started", world, timeout)
        why = f"ranks {missing} did not start (no heartbeat for {DEAD_AFTER:.0f} s, or not ready within {timeout:.0f} s)"
        store.set("go", why if missing else "")
    store.wait(["go"], timedelta(seconds=timeout + DEAD_AFTER + 5))
    if why := store.get("go").decode():
        raise CannotRun(why)


def descendants() -> list[int]:
    """PIDs of this process's descendants (its children, theirs, ...), from /proc."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    found, frontier = [], [os.getpid()]
    while frontier:
        kids = [pid for pid, ppid in parent.items() if ppid in frontier]
        found += kids
        frontier = kids
    return found


def hard_exit(code: int, line: str | None = None) -> NoReturn:
    """Print `line`, kill this process's own descendants (the library's helper processes), exit."""
    if line:
        print(line, flush=True)
    for pid in descendants():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Watchdog:
    """Ends the process (exit 1, one line) when `beat` was not called for `seconds`: a stuck
    library call (a wait without a timeout of its own) cannot hang the run."""

    def __init__(self, prefix: str, rank: int, seconds: float):
        self.prefix, self.rank, self.seconds = prefix, rank, seconds
        self.last, self.doing = time.monotonic(), "starting"
        threading.Thread(target=self._watch, daemon=True).start()

    def beat(self, doing: str) -> None:
        self.last, self.doing = time.monotonic(), doing

    def _watch(self) -> None:
        while True:
            time.sleep(1)
            if time.monotonic() - self.last > self.seconds:
                hard_exit(1, f"{self.prefix}: rank {self.rank}: no progress for {self.seconds:.0f} s ({self.doing}); giving up")


def loss_went_down(losses: list[float]) -> tuple[bool, float, float]:
    """(last < first, first, last): the mean training loss of the first and last 5 steps."""
    k = max(1, min(5, len(losses) // 4))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    return last < first, first, last


def start_or_exit(prefix: str, start: Callable, args, rank: int, world: int, watchdog: "Watchdog"):
    """`start(args, rank, world, watchdog)`'s result (the arm's store, trainer and library
    objects), once every worker has passed the start barrier; exits 3 with one line when the
    arm cannot start here. From then on SIGTERM ends the worker with one line."""
    try:
        started = start(args, rank, world, watchdog)
        watchdog.beat("start barrier")
        start_together(started[2], rank, world, args.timeout)
    except CannotRun as e:
        hard_exit(3, f"{prefix}: cannot run here: rank {rank}: {e}")
    except Exception as e:  # the store went during the start barrier
        hard_exit(3, f"{prefix}: cannot run here: rank {rank}: start failed: {type(e).__name__}: {e}")
    signal.signal(signal.SIGTERM, lambda *_: hard_exit(1, f"{prefix}: rank {rank}: terminated"))
    return started


def verdict(prefix: str, check: bool, losses: tuple[bool, float, float], synced: int, synced_text: str,
            result: dict | None, steps: int, world: int, gone: list[int]) -> int:
    """Rank 0's one line at the end, and the exit status: with `check`, whether the loss went
    down (`losses`, from `loss_went_down`) and at least one synchronisation (`synced`, said as
    `synced_text`) completed; otherwise the run's figures from its `result`."""
    down, first, last = losses
    if check:
        if not down:
            print(f"{prefix}: check failed: the loss did not go down (first {first:.4f}, last {last:.4f})")
            return 1
        if synced == 0:
            print(f"{prefix}: check failed: {synced_text} (loss {first:.4f} -> {last:.4f})")
            return 1
        print(f"{prefix}: check passed: loss {first:.4f} -> {last:.4f} in {steps} steps on {world} workers, {synced_text}")
    elif result:
        end = result["records"][-1]
        print(f"{prefix}: {steps} steps on {world} workers in {result['train_seconds']:.1f} s, "
              f"{result['samples_per_second']:.0f} samples/s, accuracy {end['accuracy']:.4f}, {synced_text}"
              + (f"; ranks {gone} did not finish" if gone else ""))  # fmt: skip
    return 0


def leave(store, world: int, gone: list[int], *shutdowns: Callable[[], object]) -> None:
    """Rank 0 leaves last: it tells the others it is closing, waits for theirs (10 s at most),
    then shuts its library's parts down (`shutdowns`, each allowed to fail)."""
    ENDING.set()
    with contextlib.suppress(Exception):  # the others no longer need this store (nor rank 0's services)
        store.set("closed/0", "1")
        wait_for(store, "closed", world, 10, gone_before=gone)
    for shutdown in shutdowns:
        with contextlib.suppress(Exception):
            shutdown()


def launch_check(prefix: str, script: str, argv: list[str], workers: int, timeout: float) -> int:
    """--check without RANK: run `workers` local worker processes of `script --check` and return
    their verdict (rank 0's line and exit status; 3 if a worker could not start)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = Path(tempfile.mkdtemp(prefix=f"{prefix}-check-"))
    out = tmp / "result.json"
    procs, logs = [], []
    for rank in range(workers):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(workers), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}  # fmt: skip
        log = open(tmp / f"rank{rank}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, script, *argv, "--out", str(out)], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))  # fmt: skip
    deadline = time.monotonic() + timeout
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.1, deadline - time.monotonic()))
    codes = [p.poll() for p in procs]
    for p, code in zip(procs, codes):
        if code is None:  # our own worker: its whole group (its library's helpers too)
            with contextlib.suppress(OSError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)

    def last_line(rank: int) -> str:
        logs[rank].seek(0)
        lines = [line.strip() for line in logs[rank] if line.strip()]
        ours = [line for line in lines if line.startswith(prefix)]
        return (ours or lines or [f"{prefix}: rank {rank} printed nothing"])[-1]

    try:
        for rank, code in enumerate(codes):
            if code == 3:
                print(last_line(rank))
                return 3
        if None in codes:
            print(f"{prefix}: check: timed out after {timeout:.0f} s (exit codes {codes}; logs in {tmp})")
            return 1
        for rank, code in enumerate(codes):
            if code != 0 and rank != 0:
                print(f"{prefix}: check: rank {rank} failed (exit {code}): {last_line(rank)} (logs in {tmp})")
                return 1
        print(last_line(0) + ("" if codes[0] == 0 else f" (logs in {tmp})"))
        return codes[0]
    finally:
        for log in logs:
            log.close()
        if codes == [0] * workers:
            shutil.rmtree(tmp, ignore_errors=True)
