"""Telling a stopped or silent peer from a dead one, and this process's own stops from its peers'.

A dead peer breaks its connections: the mailbox knows at once. A stopped one (SIGSTOP, a
debugger) or a stuck one keeps them open and only goes silent; after the timeout the others go
on without it (they *drop* it) and say so truthfully: `whereabouts` asks the process table, where
the peer runs on this machine, whether it is stopped, gone or still running. A process can be
stopped itself: `StallClock` measures the seconds it did not run, so that its own pause is
never counted as a peer's silence.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

_TICK = 0.1  # seconds between the stall clock's ticks
_STALL = 1.0  # a gap between ticks longer than this is time the process did not run


class StallClock:
    """When this process did not run (stopped, or its machine froze): a daemon thread ticks
    every `_TICK` s, and a gap of more than `_STALL` s between two ticks is a stall.
    `since(t)` also counts the gap still open, so a thread that runs first after a stop sees it
    before the ticker has woken."""

    def __init__(self):
        # (last tick, ((when a stall ended, its seconds), ...)): replaced whole, so read whole
        self._state: tuple[float, tuple[tuple[float, float], ...]] = (time.monotonic(), ())
        threading.Thread(target=self._run, name="ako-stall-clock", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(_TICK)
            now, (last, stalls) = time.monotonic(), self._state
            gap = now - last - _TICK
            self._state = (now, stalls + ((now, gap),) if gap > _STALL else stalls)

    def longest(self) -> float:
        """The longest stall so far, seconds (the one still open included)."""
        (last, stalls), now = self._state, time.monotonic()
        return max([gap for _, gap in stalls] + [now - last - _TICK])

    def since(self, t: float) -> float:
        """Seconds this process was stalled after time `t` (time.monotonic)."""
        (last, stalls), now = self._state, time.monotonic()
        open_gap = now - last - _TICK
        ended = sum(min(gap, end - t) for end, gap in stalls if end > t)
        return ended + (min(open_gap, now - t) if open_gap > _STALL else 0.0)


STARTED_KEY = "ako/started"  # in the job's store once rank 0 asks for its first step


def mark_started(store) -> None:
    """Rank 0, at its first training step: the start-up (the process groups, the start
    barrier, the strategy's plan and its collectives) is over for every rank. A launcher
    survives the loss of a worker only from then on: before, the others would wait out the
    start-up timeout for the lost one."""
    store.set(STARTED_KEY, "1")


def has_started(store) -> bool:
    """Whether rank 0 has marked the job started (`mark_started`); False if the store is gone."""
    try:
        return store.check([STARTED_KEY])
    except RuntimeError:  # the store's own errors (DistStoreError is a RuntimeError)
        return False


def _key(rank: int) -> str:
    return f"ako/process/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{rank}"


def record(store, rank: int) -> None:
    """Put this process's host and pid in the job's store, for `whereabouts`."""
    store.set(_key(rank), f"{socket.gethostname()} {os.getpid()}")


def process_state(pid: int) -> str | None:
    """The state letter of process `pid` in /proc (R, S, D, T, t, Z...), or None when it is gone
    or there is no /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP, or a debugger): state T or t."""
    return process_state(pid) in ("T", "t")


def all_stopped(pids) -> bool:
    """Whether every process of `pids` is stopped: after rank 0 is done, none of them would
    end by itself, so a launcher has nothing left to wait for."""
    return all(is_stopped(pid) for pid in pids)


def record_cause(store, rank: int, cause: str) -> None:
    """The launcher, which saw `rank`'s process end: how ("killed by SIGKILL"), for the
    summary's lost line, where rank 0 knows only the broken connection."""
    try:
        store.set(f"{_key(rank)}/cause", cause)
    except Exception:  # noqa: BLE001 - the store's own errors: the summary keeps rank 0's reason
        pass


def with_cause(store, loss: dict) -> dict:
    """`loss` (`Mailbox.losses`) with the launcher's cause as the reason of a rank that died,
    where it has recorded one (`record_cause`)."""
    key = f"{_key(loss['rank'])}/cause"
    try:
        if loss["how"] == "died" and store.check([key]):
            return {**loss, "reason": store.get(key).decode()}
    except Exception:  # noqa: BLE001 - the store is gone or broken: rank 0's own reason
        pass
    return loss


def first_report(store, rank: int) -> bool:
    """Whether this process is the first to report `rank` dropped: two peers that time out on
    it together would each say so. True when the store is gone (better twice than never)."""
    try:
        return store.add(f"{_key(rank)}/dropped", 1) == 1
    except Exception:  # noqa: BLE001 - the store's own errors, or it is gone
        return True


def whereabouts(store, rank: int) -> str:
    """What became of `rank`, silent for the timeout: "stopped" (stopped on this machine),
    "died" (its process is gone from this machine) or "silent" (it runs on another machine, or
    runs here but sends nothing: stuck, or far too slow)."""
    try:
        host, pid = store.get(_key(rank)).decode().split() if store.check([_key(rank)]) else ("", "0")
    except Exception:  # noqa: BLE001 - the store is gone: say no more than "silent"
        return "silent"
    if host != socket.gethostname():
        return "silent"
    state = process_state(int(pid))
    return "stopped" if state in ("T", "t") else "died" if state in (None, "Z") else "silent"
