"""The point-to-point mailbox on real processes: sends to a live peer never count as stuck,
however long the run, and the sends in flight stay few; a process's own stops are its own;
the consensus measurement's copies are held back while training."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ako.runtime.distributed.process import join_process_group
from ako.runtime.distributed.launcher import launch_function
from ako.runtime.distributed.liveness import first_report, is_stopped
from ako.runtime.distributed.mailbox import Mailbox, Silent
from ako.runtime.distributed.replicas import MailboxReplicas
from ako.run.evaluation import snapshots_kept
from ako.strategies.tags import REPLICA


def exchange_for(seconds: float, timeout: float) -> dict:
    """Rank 0 sends rank 1 a 1 MB message every 50 ms for `seconds`, with a mailbox timeout far
    shorter than that; returns what rank 0 saw (rank 1: what it received)."""
    rank, world, _ = join_process_group(30.0, "gloo")
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    mailbox = Mailbox(rank, [1 - rank], group, timeout, on_stop=lambda: None)
    sent = received = most_pending = 0
    start = time.monotonic()
    if rank == 0:
        while time.monotonic() - start < seconds:
            mailbox.send(torch.full((1 << 18,), float(sent)), 1, tag=0, step=sent)
            sent += 1
            most_pending = max(most_pending, len(mailbox.pending))
            time.sleep(0.05)
        mailbox.send(torch.empty(0), 1, tag=1)
    else:
        while not mailbox.poll(1):
            for m in mailbox.poll(0):
                assert m.step == received and m.tensor[0].item() == received
                received += 1
            time.sleep(0.01)
        received += len(mailbox.poll(0))
    mailbox.close(timeout)
    return {"sent": sent, "received": received, "most_pending": most_pending}


def test_a_run_longer_than_the_timeout_keeps_sending():
    results = launch_function(exchange_for, 2, 4.0, 1.0)
    assert results[0]["sent"] == results[1]["received"] > 40
    # each message is two sends (header, payload); settled half a second after posting
    assert results[0]["most_pending"] <= 2 * (0.5 / 0.05 + 2)


def wait_on(timeout: float) -> dict:
    """Rank 0 waits, from any source, on rank 1 while it is busy for 3 timeouts (alive: its
    receive thread answers pings), on rank 2 while it is stopped, and on anyone with no peer
    named; returns how each wait ended and how long it took."""
    rank, world, _ = join_process_group(30.0, "gloo")
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    mailbox = Mailbox(rank, [p for p in range(world) if p != rank], group, timeout, on_stop=lambda: None)
    seen = {}
    if rank == 0:
        pid = mailbox.get(8, 2, 30.0).step
        for name, tag, awaiting in [("busy", 5, {1}), ("stopped", 6, {2}), ("anyone", 7, set())]:
            start = time.monotonic()
            try:
                seen[name] = ("message from", mailbox.get(tag, None, timeout, awaiting=frozenset(awaiting)).src)
            except Silent as e:
                seen[name] = (str(e), e.peers)
            seen[name] += (time.monotonic() - start,)
        os.kill(pid, signal.SIGCONT)
        mailbox.get(8, 2, 30.0)  # back: sends to it need not wait out its silence
        for peer in (1, 2):
            mailbox.send(torch.empty(0), peer, 9)
    elif rank == 1:
        time.sleep(3 * timeout)
        mailbox.send(torch.empty(0), 0, 5)
        mailbox.get(9, 0, 30.0)
    else:
        mailbox.send(torch.empty(0), 0, 8, step=os.getpid())
        time.sleep(0.5)  # the message leaves before the stop
        os.kill(os.getpid(), signal.SIGSTOP)
        mailbox.send(torch.empty(0), 0, 8)
        mailbox.get(9, 0, 30.0)
    mailbox.close(30.0)
    return seen


def test_a_wait_from_any_source_lasts_while_an_awaited_peer_is_alive():
    """A server's wait for a push from any of its workers: it lasts while one of them shows
    signs of life, however long that is (a worker busy evaluating for longer than the
    timeout), and ends after the timeout naming the awaited peers when none does."""
    seen = launch_function(wait_on, 3, 1.0)[0]
    assert seen["busy"][:2] == ("message from", 1) and 2.5 < seen["busy"][2] < 6, seen
    assert seen["stopped"][:2] == ("no message from worker rank 2 for 1 s (awaiting 6)", [2]), seen
    assert seen["anyone"][:2] == ("no message from any peer for 1 s (awaiting 7)", []), seen
    assert 0.9 < seen["stopped"][2] < 3 and 0.9 < seen["anyone"][2] < 3, seen


def test_the_stall_clock_counts_the_time_the_process_was_stopped():
    """A process stopped for 2 s sees those 2 s as its own stall (so they never count as a
    peer's silence), both before and after its ticker has woken; nothing before the stop."""
    code = (
        "import os, signal, time\n"
        "from ako.runtime.distributed.liveness import StallClock\n"
        "c = StallClock(); time.sleep(0.3); t = time.monotonic()\n"
        "os.kill(os.getpid(), signal.SIGSTOP)\n"
        "first = c.since(t); time.sleep(0.3); after = time.monotonic(); time.sleep(0.3)\n"
        "print(first, c.since(t), c.since(after))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not is_stopped(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(2.0)
    os.kill(proc.pid, signal.SIGCONT)
    first, whole, later = map(float, proc.communicate(timeout=30)[0].split())
    assert 1.5 < first < 4.5 and 1.5 < whole < 4.5 and abs(first - whole) < 0.3, (first, whole)
    assert later == 0.0


def test_a_dropped_worker_is_reported_by_the_first_peer_only():
    """Two peers that time out on one stopped worker together: only the first says so; a
    second worker dropped later is reported too."""
    store = dist.HashStore()
    assert [first_report(store, 1), first_report(store, 1), first_report(store, 2)] == [True, False, True]


class _Outbox:
    """A mailbox that records what is sent."""

    lost: set = set()

    def __init__(self):
        self.sent: list[tuple[int, int, int, float]] = []

    def send(self, tensor, dst, tag, step=0, aux=0, drop_lost=False):
        self.sent.append((dst, tag, step, tensor[0].item()))


def test_a_worker_holds_its_replica_copies_back_until_its_training_ends():
    """Copies for the consensus measurement: with `hold` 2, the third point sends the oldest
    and the rest go at the end, each a copy of the replica as it was at its point; with 0
    (rank 0 evaluates during training), each goes at once."""
    box, params = _Outbox(), torch.zeros(3)
    held = MailboxReplicas(box, 4, hold=2)
    for point in range(3):
        params.fill_(point)
        held.report_replica(point, params)
    params.fill_(9.0)
    assert box.sent == [(0, REPLICA, 0, 0.0)]
    held.send_held()
    assert box.sent == [(0, REPLICA, k, float(k)) for k in range(3)]
    at_once = MailboxReplicas(box := _Outbox(), 4, hold=0)
    at_once.report_replica(5, params)
    assert box.sent == [(0, REPLICA, 5, 9.0)]
    # what a run that evaluates after training holds: the points rank 0 keeps (256 MB with 4 cnn replicas each)
    assert snapshots_kept(4, 827_688) == 81
