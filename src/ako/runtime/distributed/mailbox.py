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
(a copy of a replica for rank 0's consensus measurement), CHECKPOINT (save at step `step`), DROPPED
(rank `aux` was silent for the timeout and is dropped).

Silent peers. A Gloo send completes only once the receiver has posted its recv, and a wait
on it that times out closes the connection for good; so a send is waited on only once its
peer has been heard from since it was posted (any message; PING asks a quiet peer for a
PONG, which its receive thread sends after reading everything before it). A peer that stays
silent for the timeout (stopped, stuck, or far too slow) is, under a tolerant program,
dropped (`drop`): it is lost, the other peers are told so at once (they need not each wait
out the timeout on it), and so is the peer itself, over its still open connection, so that it
ends with `Dropped` when it runs again; whatever it sends afterwards is discarded. Sends to it
are kept, never waited on (`parked`). Time this process was stopped itself never counts
against a peer (`liveness.StallClock`).

Published snapshots: `publish` makes a tensor the one this worker serves. The receive thread
that reads a peer's SNAPSHOT_REQUEST answers it at once with the latest snapshot (or, before the first
`publish`, at that publish), so the publisher's training never stops to answer, and any number
of peers may pull from each other at the same time without waiting on one another's programs.
Sends come from the receive threads too, so sending is serialised by a lock: a message's header
and payload must not interleave with another's.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ako.metrics import loss_text
from ako.runtime.distributed.liveness import StallClock
from ako.strategies import tags
from ako.strategies.ops import Message, PeerLost
from ako.strategies.tags import CHECKPOINT, CLOSE, DROPPED, PING, PONG, RUN_STOP, SNAPSHOT, SNAPSHOT_REQUEST

_HEADER_TAG, _PAYLOAD_TAG = 1, 2
_FOREVER = timedelta(days=365)
_SETTLE_AFTER = 0.5  # seconds after which a send to a live peer has been taken
_DROPPED_WORD = 3.0  # seconds a worker stopped past the timeout waits for the word that it was dropped
_MAX_PENDING = 256  # sends in flight to one peer before the sender waits for it (backpressure)
_DTYPES = [torch.float32, torch.float64, torch.int64, torch.float16, torch.bfloat16, torch.uint8]


class Silent(TimeoutError):
    """No message with `tag` for `timeout` s from `peers` (the awaited ranks; none: anyone)."""

    def __init__(self, tag: int, timeout: float, peers: list[int], role: Callable[[int], str]):
        self.peers = sorted(peers)
        who = "any peer"
        if len(peers) == 1:
            who = f"{role(peers[0])} rank {peers[0]}"
        elif peers:
            who = f"any of ranks {', '.join(map(str, self.peers))}"
        super().__init__(f"no message from {who} for {timeout:g} s (awaiting {tags.name(tag)})")


class Dropped(RuntimeError):
    """The other workers went on without this one: it was silent for their timeout (stopped,
    stuck or far too slow). It cannot rejoin; it can only end."""


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
        on_stop: Callable[[], None], on_checkpoint: Callable[[int], None] = lambda step: None, workers: int | None = None,
    ):  # fmt: skip
        self.rank, self.peers, self.group, self.on_stop, self.on_checkpoint = rank, peers, group, on_stop, on_checkpoint
        self.workers = workers  # ranks from `workers` on are servers (None: all are workers)
        self.timeout = timeout
        self.queues: dict[int, deque[Message]] = {}
        self.lost: dict[int, str] = {}  # rank -> why: died, or dropped after a silence (`silent`)
        self.silent: set[int] = set()
        self.how: dict[int, str] = {}  # rank -> "died", or what `whereabouts` found when it was dropped
        self.whereabouts: Callable[[int], str] = lambda rank: "silent"
        self.first_report: Callable[[int], bool] = lambda rank: True  # whether to say a drop (one peer says it)
        self.dropped: str | None = None  # why the others went on without this worker
        self.stalls = StallClock()
        self.told: set[int] = set()  # losses already reported to a tolerant program
        self.cond = threading.Condition()
        self.pending: dict[int, deque[_Send]] = {p: deque() for p in peers}  # sends in flight, oldest first
        self.parked: list[_Send] = []  # sends to dropped peers: alive until the process ends, never waited on
        self.heard = {p: -1.0 for p in peers}  # when each peer's last message came (time.monotonic)
        self.pinged = {p: -1.0 for p in peers}  # when each was last asked for a sign of life
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
        `drop_lost`, sends to a peer that is gone are dropped instead, and a peer silent for
        `timeout` is dropped (`drop`). Raises Dropped when the others dropped this worker.
        """
        # Settle outside the lock: its waits could otherwise stall this worker's receive threads,
        # which need the lock to answer pulls, and two workers pulling from each other could
        # each wait for the other's thread. Only this (the program's) thread takes from the
        # left of a `pending` queue; receive threads append on the right (deque operations are atomic).
        self._raise_if_dropped()
        self._settle(drop_lost)
        with self.send_lock:
            try:
                self._post(tensor, dst, tag, step, aux)
            except RuntimeError as e:
                if not drop_lost:
                    raise self._lost_error(dst, comm_error(e)) from None

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
        self.pending[dst].extend(_Send(w, (header, tensor), dst, now) for w in works)
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
        """Wait for the sends posted more than `_SETTLE_AFTER` s ago to peers heard from since
        (their receive threads have taken them, or are taking them), and, while more than
        `_MAX_PENDING` are in flight to one peer, for a sign of life from it first. A Gloo send's
        work reports completion only once waited on, so waiting is the only way to free its
        tensors. Raises PeerLost for a peer that is gone, or silent for `timeout` s after a
        ping; with `drop_lost` a silent peer is dropped and a dead one left out instead."""
        now = time.monotonic()
        for peer, queue in self.pending.items():
            while queue and (now - queue[0].posted > _SETTLE_AFTER or len(queue) > _MAX_PENDING):
                oldest = queue[0]
                if peer not in self.lost and self.heard[peer] < oldest.posted:
                    if self.pinged[peer] < oldest.posted:  # not asked since: ask now
                        self._ping(peer, now)
                    asked = self.pinged[peer]
                    if len(queue) <= _MAX_PENDING and now - asked < self.timeout:
                        break  # not yet: a live peer answers soon
                    self._await_sign(peer, oldest.posted, asked, drop_lost)
                queue.popleft()
                self._finish(oldest, drop_lost)

    def _ping(self, peer: int, now: float) -> None:
        self.pinged[peer] = now
        with self.send_lock:
            self._post_quietly(peer, PING)

    def _await_sign(self, peer: int, since: float, asked: float, drop_lost: bool) -> None:
        """Wait until `peer` is heard from after `since`, for at most `timeout` s from `asked`
        (when it was pinged; less the time this process was stopped since); after that it is
        silent: dropped (with `drop_lost`, unless it is `vital`: rank 0 or a server) or PeerLost."""
        with self.cond:
            while self.heard[peer] < since and peer not in self.lost:
                left = asked + self.timeout + self.stalls.since(asked) - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(min(left, _SETTLE_AFTER))
        if self.heard[peer] >= since or peer in self.lost:
            return
        reason = f"took no message for {self.timeout:g} s"
        if not drop_lost or self.vital(peer):
            raise self._lost_error(peer, f"{reason} (stuck, or far too slow)")
        self.drop(peer, reason)

    def _finish(self, send: _Send, drop_lost: bool) -> None:
        """Wait for one send to complete (its peer has been heard from since it was posted)."""
        if send.dst in self.lost:
            if send.dst in self.silent:
                self.parked.append(send)  # its connection is open: the peer may still read it
            return
        try:
            send.work.wait()
        except RuntimeError as e:
            if not drop_lost:
                raise self._lost_error(send.dst, comm_error(e)) from None
            with self.cond:  # its receive thread may not have seen the broken connection yet
                self.lost.setdefault(send.dst, comm_error(e))
                self.how.setdefault(send.dst, "died")

    def _post_quietly(self, peer: int, tag: int, aux: int = 0) -> None:
        """Post an empty message of the runtime's own (caller holds `send_lock`); a peer that is
        gone is left to its receive thread here, which records that."""
        try:
            self._post(torch.empty(0), peer, tag, 0, aux)
        except RuntimeError:
            pass

    def drop(self, peer: int, reason: str) -> None:
        """Go on without `peer`, alive but silent (`reason`): it is lost from now on, and it
        and every other live peer are told (DROPPED), so that they need not wait out the
        timeout on it too."""
        how = self.whereabouts(peer)  # outside the lock: it may ask the job's store
        reason = f"{reason}; found by rank {self.rank}"  # as the peers told record it (`_dropped`)
        with self.cond:
            if peer in self.lost:
                return
            self.lost[peer], self.silent, self.how[peer] = reason, self.silent | {peer}, how
            self.cond.notify_all()
            told = [p for p in self.peers if p == peer or p not in self.lost]
        with self.send_lock:  # not `send`: this may run inside its `_settle`
            for other in told:
                self._post_quietly(other, DROPPED, peer)
        if self.first_report(peer):  # as the launcher says a death: when it happens, once
            loss = {"rank": peer, "role": self._role(peer), "how": how, "reason": reason}
            print(f"ako: {loss_text(loss)}", file=sys.stderr, flush=True)

    def get(self, tag: int, src: int | None, timeout: float, tolerant: bool = False, awaiting=frozenset()) -> Message:
        """Wait for the next message with `tag` from `src`, as long as `src` shows signs of life
        (it is pinged while the wait lasts: a live but slow peer is waited for); from any
        source, as long as one of `awaiting` (the peers the message may come from) does, or,
        without them, for up to `timeout` seconds.

        Raises PeerLost when the awaited peer is gone (for any source: any peer, or, when
        `tolerant`, a peer whose loss has not been reported yet, once), Silent (a TimeoutError)
        after `timeout` seconds of silence, and Dropped when the others dropped this worker.
        """
        start = time.monotonic()
        with self.cond:
            while True:
                message = self._take(tag, src)
                if message is not None:
                    return message
                self._raise_if_dropped()
                self._raise_if_lost(src, tolerant)
                now = time.monotonic()
                watched = [src] if src is not None else [p for p in awaiting if p not in self.lost]
                quiet_since = max([start, *(self.heard[p] for p in watched)])
                left = quiet_since + timeout + self.stalls.since(quiet_since) - now  # our own stops do not count
                if left <= 0:
                    raise Silent(tag, timeout, watched, self._role)
                for peer in watched:
                    if now - max(quiet_since, self.pinged[peer]) > timeout / 4:
                        self.pinged[peer] = now
                        with self.send_lock:
                            self._post_quietly(peer, PING)
                self.cond.wait(min(left, timeout / 4))

    def poll(self, tag: int, tolerant: bool = False) -> list[Message]:
        """Every message with `tag` received so far, oldest first. Raises PeerLost if a peer is
        gone, unless `tolerant`."""
        with self.cond:
            self._raise_if_dropped()
            if not tolerant:
                self._raise_if_lost(None)
            queue = self.queues.get(tag)
            if not queue:
                return []
            messages = list(queue)
            queue.clear()
            return messages

    def arrived(self, tag: int, step: int) -> bool:
        """Whether a message with `tag` and a step >= `step` has come and waits to be taken
        (it is left in place): `ops.ComputePartial`'s signal to stop."""
        with self.cond:
            return any(m.step >= step for m in self.queues.get(tag, ()))

    def close(self, timeout: float) -> None:
        """Tell every peer we are done, wait for theirs and for our sends to complete."""
        for peer in self.peers:
            if peer not in self.lost:
                self.send(torch.empty(0), peer, CLOSE, drop_lost=True)
        deadline = time.monotonic() + timeout
        for peer, thread in zip(self.peers, self.threads, strict=True):
            if peer not in self.silent:  # a dropped peer may never say goodbye
                thread.join(max(0.0, deadline - time.monotonic()))
        with self.send_lock:  # receive threads may still append answers
            pending = [p for queue in self.pending.values() for p in queue if p.dst not in self.lost]
        said_goodbye = {peer for peer, thread in zip(self.peers, self.threads, strict=True) if not thread.is_alive()}
        for p in pending:
            try:
                p.work.wait(timedelta(seconds=max(0.1, deadline - time.monotonic())))
            except RuntimeError:
                if p.dst not in said_goodbye:
                    raise
                # A peer that said goodbye is done and may have closed its connections first (a
                # straggler finishes last): what was still going to it, it no longer needs.
        for queue in self.pending.values():
            queue.clear()

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

    def losses(self) -> list[dict]:
        """Every lost rank, by rank: {"rank", "role", "how" ("died", or when it was dropped for
        its silence "stopped" or "silent"), "reason"}."""
        with self.cond:
            return [{"rank": r, "role": self._role(r), "how": self.how.get(r, "died"), "reason": self.lost[r]}
                    for r in sorted(self.lost)]  # fmt: skip

    def _role(self, rank: int) -> str:
        return "server" if self.workers is not None and rank >= self.workers else "worker"

    def vital(self, rank: int) -> bool:
        """Whether no strategy goes on without `rank`: rank 0 (it evaluates and reports) or a
        server (it holds a shard of the model). Such a peer's silence fails this rank (one
        line, from the launcher) rather than dropping the peer."""
        return rank == 0 or self._role(rank) == "server"

    def peer_lost(self, rank: int, reason: str | None = None) -> PeerLost:
        """The PeerLost for `rank`, naming its role, for `reason` (default: why it is lost)."""
        return PeerLost(rank, self.lost[rank] if reason is None else reason, self._role(rank))

    def _lost_error(self, rank: int, reason: str | None = None) -> Exception:
        """PeerLost for `rank`; or Dropped, when this process was itself stopped for longer than
        the timeout and the word that the others dropped it comes within `_DROPPED_WORD` s (its
        peers may end, and close their connections, before it reads that word)."""
        stopped = self.stalls.longest()
        if self.dropped is None and stopped > self.timeout:
            deadline = time.monotonic() + _DROPPED_WORD
            with self.cond:
                while self.dropped is None and time.monotonic() < deadline:
                    self.cond.wait(0.1)
        if self.dropped is not None:
            return Dropped(f"dropped by the others: {self.dropped}")
        if stopped > self.timeout and self.rank != 0:  # the word was lost with a dropper that ended
            return Dropped(f"dropped by the others: it was stopped for {stopped:.0f} s, past the {self.timeout:g} s timeout")
        return self.peer_lost(rank, reason)

    def _raise_if_dropped(self) -> None:
        if self.dropped is not None:
            raise Dropped(f"dropped by the others: {self.dropped}")

    def _raise_if_lost(self, src: int | None, tolerant: bool = False) -> None:
        if src is not None and src in self.lost:
            raise self._lost_error(src)
        if src is None and tolerant:
            news = set(self.lost) - self.told
            if news:
                rank = min(news)
                self.told.add(rank)
                raise self._lost_error(rank)
        elif src is None and self.lost:
            raise self._lost_error(min(self.lost))

    def _receive(self, peer: int) -> None:
        header = torch.empty(5, dtype=torch.int64)
        try:
            while True:
                _receive(header, peer, self.group, _HEADER_TAG)
                tag, step, aux, numel, dtype = header.tolist()
                self.heard[peer] = time.monotonic()
                if tag == CLOSE:
                    return
                payload = torch.empty(numel, dtype=_DTYPES[dtype])
                if numel:
                    _receive(payload, peer, self.group, _PAYLOAD_TAG)
                if peer in self.silent:  # dropped: what it sends now would only confuse the ledgers
                    continue
                if tag == RUN_STOP:
                    self.on_stop()
                    continue
                if tag == CHECKPOINT:
                    self.on_checkpoint(step)
                    continue
                if tag == DROPPED:
                    self._dropped(peer, aux)
                    continue
                if tag == PING:
                    with self.send_lock:
                        self._post_quietly(peer, PONG)
                    continue
                if tag == PONG:
                    with self.cond:
                        self.cond.notify_all()  # `_await_sign` may be waiting for it
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
                self.lost.setdefault(peer, comm_error(e))
                self.how.setdefault(peer, "died")
                self.cond.notify_all()

    def _dropped(self, src: int, rank: int) -> None:
        """Peer `src` dropped `rank` (a receive thread): this worker, or another peer."""
        how = self.whereabouts(rank) if rank != self.rank else ""
        with self.cond:
            if rank == self.rank:
                self.dropped = f"rank {src} found it silent for {self.timeout:g} s (stopped, stuck or far too slow)"
            elif rank not in self.lost:
                self.lost[rank] = f"silent for {self.timeout:g} s; found by rank {src}"
                self.silent, self.how[rank] = self.silent | {rank}, how
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
