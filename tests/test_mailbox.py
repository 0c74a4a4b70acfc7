"""The point-to-point mailbox on real processes: sends to a live peer never count as stuck,
however long the run, and the sends in flight stay few."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ako.runtime.distributed.process import join_process_group
from ako.runtime.distributed.launcher import launch_function
from ako.runtime.distributed.mailbox import Mailbox


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
