"""Asynchronous point-to-point messages on torch.distributed: a header, then a payload.

A message is a header of five int64 (tag, step, aux, numel, dtype code) followed by a flat
payload tensor of `numel` elements; nothing received is unpickled. Sends are `isend`s (a Gloo
`send` blocks until the receiver posts its `recv`), so a worker never waits on a slow peer to
send. One receive thread per peer posts `recv`s in a loop and files messages by tag: a peer
that dies breaks its connection, its thread records that at once, and any wait on it fails
with `PeerLost` naming the rank (an any-source `recv` would not notice a dead peer).
A live peer may be silent for as long as it likes: the waits for messages have the timeouts. Negative
tags are the runtime's own (`ako.strategies.tags`): RUN_STOP (the target accuracy was reached), CLOSE (the peer is done),
PROBE (bandwidth probe), REPORT and FINAL (end-of-run counts and parameters for rank 0),
SNAPSHOT_REQUEST and SNAPSHOT (a request for this worker's published snapshot, and the answer), REPLICA
(a copy of a replica for rank 0's consensus measurement), CHECKPOINT (save at step `step`).

Published snapshots: `publish` makes a tensor the one this worker serves. The receive thread
that reads a peer's SNAPSHOT_REQUEST answers it at once with the latest snapshot (or, before the first
`publish`, at that publish), so the publisher's training never stops to answer, and any number
of peers may pull from each other at the same time without waiting on one another's programs.
Sends come from the receive threads too, so sending is serialised by a lock: a message's header
and payload must not interleave with another's.
"""

from __future__ import annotations

import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ako.strategies.ops import Message, PeerLost
from ako.strategies.tags import CHECKPOINT, CLOSE, RUN_STOP, SNAPSHOT, SNAPSHOT_REQUEST

_HEADER_TAG, _PAYLOAD_TAG = 1, 2
_FOREVER = timedelta(days=365)
_SETTLE_AFTER = 0.5  # seconds after which a send to a live peer has been taken
_MAX_PENDING = 256
_DTYPES = [torch.float32, torch.float64, torch.int64, torch.float16, torch.bfloat16, torch.uint8]


@dataclass
class _Send:
    """A send in flight: its tensors must live until the work completes."""

    work: object
    tensors: tuple
    dst: int
    posted: float


class Mailbox:
    """This worker's sending side and inbox for point-to-point messages.

    `group` is a process group used only for these messages, so their tags can never collide
    with the collectives' internal tags. Counters: `bytes_sent` and `bytes_received` count
    the payloads of strategy messages (tags >= 0) and of snapshots served to pulls; headers
    (40 bytes a message) are left out.
    """

    def __init__(
        self, rank: int, peers: list[int], group, timeout: float,
        on_stop: Callable[[], None], on_checkpoint: Callable[[int], None] = lambda step: None,
    ):  # fmt: skip
        self.rank, self.peers, self.group, self.on_stop, self.on_checkpoint = rank, peers, group, on_stop, on_checkpoint
        self.timeout = timeout
        self.queues: dict[int, deque[Message]] = {}
        self.lost: dict[int, str] = {}
        self.told: set[int] = set()  # losses already reported to a tolerant program
        self.cond = threading.Condition()
        self.pending: deque[_Send] = deque()  # sends in flight, oldest first
        self.send_lock = threading.Lock()  # the main thread and the receive threads send
        self.published: tuple[torch.Tensor, int] | None = None  # (snapshot, step)
        self.unanswered: list[int] = []  # peers that pulled before the first publish
        self.bytes_sent = self.bytes_received = 0
        self.threads = [
            threading.Thread(target=self._receive, args=(peer,), name=f"ako-recv-{peer}", daemon=True)
            for peer in peers
        ]
        for thread in self.threads:
            thread.start()

    def send(self, tensor: torch.Tensor, dst: int, tag: int, step: int = 0, aux: int = 0, drop_lost: bool = False) -> None:
        """Start sending `tensor` (flat, contiguous, CPU) to `dst`; returns at once.

        Raises PeerLost when `dst` is gone, or has taken none of our messages for `timeout`
        seconds (stuck): unsent messages would otherwise pile up without bound. With
        `drop_lost`, sends to a peer that is gone are dropped instead.
        """
        # Settle outside the lock: its waits could otherwise stall this worker's receive threads,
        # which need the lock to answer pulls, and two workers pulling from each other could
        # each wait for the other's thread. Only this (the program's) thread takes from the
        # left of `pending`; receive threads append on the right (deque operations are atomic).
        self._settle(drop_lost)
        with self.send_lock:
            try:
                self._post(tensor, dst, tag, step, aux)
            except RuntimeError as e:
                if not drop_lost:
                    raise PeerLost(dst, comm_error(e)) from None

    def publish(self, tensor: torch.Tensor, step: int) -> None:
        """Make `tensor` (flat, CPU, never modified afterwards) the snapshot served to peers'
        PULL requests, with `step` in the answer's header; answer the pulls that came first."""
        snapshot = (tensor, step)
        with self.cond:
            self.published, waiting, self.unanswered = snapshot, self.unanswered, []
        for peer in waiting:
            self._answer(peer, snapshot)

    def _post(self, tensor: torch.Tensor, dst: int, tag: int, step: int, aux: int) -> None:
        """isend the header and payload (caller holds `send_lock`). Raises RuntimeError."""
        header = torch.tensor([tag, step, aux, tensor.numel(), _DTYPES.index(tensor.dtype)], dtype=torch.int64)
        works = [dist.isend(header, dst, group=self.group, tag=_HEADER_TAG)]
        if tensor.numel():
            works.append(dist.isend(tensor, dst, group=self.group, tag=_PAYLOAD_TAG))
        now = time.monotonic()
        self.pending.extend(_Send(w, (header, tensor), dst, now) for w in works)
        if _is_traffic(tag):
            self.bytes_sent += tensor.numel() * tensor.element_size()

    def _serve(self, peer: int) -> None:
        """A PULL from `peer` (receive thread): answer with the latest snapshot, or queue it."""
        with self.cond:
            snapshot = self.published
            if snapshot is None:
                self.unanswered.append(peer)
                return
        self._answer(peer, snapshot)

    def _answer(self, peer: int, snapshot: tuple[torch.Tensor, int]) -> None:
        with self.send_lock:
            try:
                self._post(snapshot[0], peer, SNAPSHOT, snapshot[1], 0)
            except RuntimeError:  # the requester is gone: its receive thread here records that
                pass

    def _settle(self, drop_lost: bool) -> None:
        """Wait for the sends posted more than `_SETTLE_AFTER` s ago (a live peer's receive
        thread has taken them long since), and for the oldest while more than `_MAX_PENDING`
        are in flight. A Gloo send's work reports completion only once waited on, so waiting
        is the only way to free its tensors; the wait is bounded by the group's timeout.
        Raises PeerLost for a peer that is gone or took nothing for `timeout` s (unless
        `drop_lost`, for a peer that is gone)."""
        now = time.monotonic()
        while self.pending and (now - self.pending[0].posted > _SETTLE_AFTER or len(self.pending) > _MAX_PENDING):
            p = self.pending.popleft()
            if drop_lost and p.dst in self.lost:
                continue
            try:
                p.work.wait()
            except RuntimeError as e:
                if drop_lost and p.dst in self.lost:
                    continue
                stuck = "timed out" in str(e).lower() or "timeout" in str(e).lower()
                reason = f"took no message for {self.timeout:g} s (stuck, or far too slow)" if stuck else comm_error(e)
                raise PeerLost(p.dst, reason) from None

    def get(self, tag: int, src: int | None, timeout: float, tolerant: bool = False) -> Message:
        """Wait up to `timeout` seconds for the next message with `tag` (from `src`, or any).

        Raises PeerLost when the awaited peer is gone (for any source: any peer, or, when
        `tolerant`, a peer whose loss has not been reported yet, once), and TimeoutError after
        `timeout` seconds of silence.
        """
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                message = self._take(tag, src)
                if message is not None:
                    return message
                self._raise_if_lost(src, tolerant)
                left = deadline - time.monotonic()
                if left <= 0:
                    who = "any peer" if src is None else f"worker rank {src}"
                    raise TimeoutError(f"no message from {who} for {timeout:g} s (tag {tag})")
                self.cond.wait(left)

    def poll(self, tag: int, tolerant: bool = False) -> list[Message]:
        """Every message with `tag` received so far, oldest first. Raises PeerLost if a peer is
        gone, unless `tolerant`."""
        with self.cond:
            if not tolerant:
                self._raise_if_lost(None)
            queue = self.queues.get(tag)
            if not queue:
                return []
            messages = list(queue)
            queue.clear()
            return messages

    def close(self, timeout: float) -> None:
        """Tell every peer we are done, wait for theirs and for our sends to complete."""
        for peer in self.peers:
            if peer not in self.lost:
                self.send(torch.empty(0), peer, CLOSE, drop_lost=True)
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self.send_lock:  # receive threads may still append answers
            pending = list(self.pending)
        for p in pending:
            if p.dst not in self.lost:
                p.work.wait(timedelta(seconds=max(0.1, deadline - time.monotonic())))
        self.pending.clear()

    def _take(self, tag: int, src: int | None) -> Message | None:
        queue = self.queues.get(tag)
        if not queue:
            return None
        if src is None:
            return queue.popleft()
        for i, message in enumerate(queue):
            if message.src == src:
                del queue[i]
                return message
        return None

    def _raise_if_lost(self, src: int | None, tolerant: bool = False) -> None:
        if src is not None and src in self.lost:
            raise PeerLost(src, self.lost[src])
        if src is None and tolerant:
            news = set(self.lost) - self.told
            if news:
                rank = min(news)
                self.told.add(rank)
                raise PeerLost(rank, self.lost[rank])
        elif src is None and self.lost:
            rank = min(self.lost)
            raise PeerLost(rank, self.lost[rank])

    def _receive(self, peer: int) -> None:
        header = torch.empty(5, dtype=torch.int64)
        try:
            while True:
                _receive(header, peer, self.group, _HEADER_TAG)
                tag, step, aux, numel, dtype = header.tolist()
                if tag == CLOSE:
                    return
                payload = torch.empty(numel, dtype=_DTYPES[dtype])
                if numel:
                    _receive(payload, peer, self.group, _PAYLOAD_TAG)
                if tag == RUN_STOP:
                    self.on_stop()
                    continue
                if tag == CHECKPOINT:
                    self.on_checkpoint(step)
                    continue
                if tag == SNAPSHOT_REQUEST:
                    self._serve(peer)
                    continue
                with self.cond:
                    if _is_traffic(tag):
                        self.bytes_received += payload.numel() * payload.element_size()
                    self.queues.setdefault(tag, deque()).append(Message(peer, tag, step, aux, payload))
                    self.cond.notify_all()
        except Exception as e:  # the connection broke: the peer died or went away
            with self.cond:
                self.lost[peer] = comm_error(e)
                self.cond.notify_all()


def _is_traffic(tag: int) -> bool:
    """Strategy messages and served snapshots count as training traffic; the rest is the
    runtime's own bookkeeping."""
    return tag >= 0 or tag == SNAPSHOT


def _receive(tensor: torch.Tensor, src: int, group, tag: int) -> None:
    """Wait as long as it takes for the next message from `src`: a peer may rightly be silent
    for a whole run (all-reduce sends none). A dead peer breaks the connection and raises at
    once; a silent live one is the business of `Mailbox.get`'s timeout."""
    dist.irecv(tensor, src, group=group, tag=tag).wait(_FOREVER)


def comm_error(e: BaseException) -> str:
    """A communication error in one short line: Gloo's source location and advice dropped."""
    lines = str(e).strip().splitlines()
    text = re.sub(r"^\[[^\]]*\]\s*", "", lines[0] if lines else type(e).__name__)
    return text.split(". This is typically")[0][:200]
