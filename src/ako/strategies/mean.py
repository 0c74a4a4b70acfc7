"""The mean over every worker of a flat vector, started now and taken later, so that it can
overlap computation: DiLoCo's pseudo-gradients (`diloco.py`).

Uncompressed (`none`), one ring all-reduce (`ops.AllReduce(wait=False)`, then `ops.Wait`):
2 (n-1)/n x 4 bytes a value per worker. Compressed (`--compress bf16|int8|fp4`), the two halves
of a ring all-reduce as messages, each carrying the code's bytes, with the sum in float32 in
between (as torchft's quantised all-reduce does, with all-to-all and all-gather):
1. reduce-scatter (`start`): the vector is cut into n chunks; chunk j's code goes to worker j,
   its owner (`MEAN_SCATTER`);
2. the owner decodes the n codes of its chunk, sums them in float32 in rank order, divides by
   n and sends that mean's code to every peer (`MEAN_GATHER`, in `reduce`);
3. all-gather (`finish`): every worker decodes the n chunks of the mean.
Per worker that is 2 (n-1)/n x the code's bytes, a ring all-reduce's traffic. Both codings
leave the same mean, bit for bit, on every worker. With error feedback (`Residual`), a worker
keeps what its code left out of its own vector, and the owner keeps what the mean's code left
out (n x, as one worker's share of it): what every worker applied plus the residuals / n is
exactly the mean of what they were given plus the old residuals / n.

The stop vote (how many workers were stopping) rides along: the all-reduce's last element, or
the messages' `aux`. A peer lost meanwhile raises `ops.PeerLost` at the Wait or the Recv (the
run ends naming it: a mean needs every worker).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ako.strategies.compress import Codec, Residual
from ako.strategies.ops import AllReduce, Recv, Send, Wait
from ako.strategies.tags import MEAN_GATHER, MEAN_SCATTER


def chunks(m: int, n: int) -> list[tuple[int, int]]:
    """[lo, hi) of the n owners' chunks of m values (sizes differ by at most one)."""
    return [(j * m // n, (j + 1) * m // n) for j in range(n)]


@dataclass
class Pending:
    """A mean under way: its sequence number, the vector's length `m` and offset `lo` in the
    residual, and, compressed, the own chunk's decoded code, the votes so far, and the
    owner's mean once reduced (`mine`)."""

    seq: int
    m: int
    lo: int
    handle: object = None
    own: torch.Tensor | None = None
    votes: int = 0
    mine: torch.Tensor | None = None
    gathered: dict = field(default_factory=dict)


class Mean:
    """The mean over the `n` workers of vectors given to `start`, with `codec` on the wire and,
    for a lossy code, error feedback over `numel` coordinates (`residual`, on `device`)."""

    def __init__(self, rank: int, n: int, codec: Codec, numel: int, device: torch.device | str = "cpu"):
        self.rank, self.n, self.codec = rank, n, codec
        self.peers = [j for j in range(n) if j != rank]
        self.residual = Residual(codec, numel, device) if codec.lossy else None
        self.seq = 0

    def start(self, x: torch.Tensor, lo: int, vote: bool):
        """Start the mean of x (float32 (m,), coordinates [lo, lo + m) of the flat vector; not
        kept) with this worker's stop vote. Returns a `Pending` for `finish`."""
        pending = Pending(self.seq, len(x), lo, votes=int(vote))
        self.seq += 1
        if self.residual is None:
            buf = x.new_empty(len(x) + 1)
            buf[:-1], buf[-1] = x, float(vote)
            pending.handle = yield AllReduce(buf, "sum", wait=False)
            return pending
        parts = chunks(len(x), self.n)
        payloads, sent = self.residual.encode(x, lo, [b - a for a, b in parts])
        a, b = parts[self.rank]
        pending.own = sent[a:b]
        for j, payload in enumerate(payloads):
            if j != self.rank:
                yield Send(payload, j, MEAN_SCATTER, step=pending.seq, aux=int(vote))
        return pending

    def reduce(self, pending: Pending):
        """As the owner of a chunk: sum the workers' codes of it (waiting for them), and send
        the mean's code to every peer. Waiting for the peers' halves here, before `finish`,
        lets the second half overlap computation too."""
        if pending.handle is not None or pending.mine is not None:
            return
        a, b = chunks(pending.m, self.n)[self.rank]
        payloads = []
        for j in self.peers:
            message = yield Recv(MEAN_SCATTER, j)
            assert message.step == pending.seq, f"mean {pending.seq}: rank {j} sent chunk {message.step}"
            payloads.append(message.tensor)
            pending.votes += message.aux
        theirs = iter(self.codec.decode_chunks(payloads, [b - a] * len(payloads)).view(len(payloads), b - a) if payloads else ())
        total = pending.own.new_zeros(b - a)
        for j in range(self.n):  # in rank order, as every owner sums
            total.add_(pending.own if j == self.rank else next(theirs))
        payload, pending.mine = self._encode_mean(total, pending.lo + a)
        for j in range(self.n):
            if j != self.rank:
                yield Send(payload, j, MEAN_GATHER, step=pending.seq, aux=pending.votes)

    def _encode_mean(self, total: torch.Tensor, lo: int) -> tuple[torch.Tensor, torch.Tensor]:
        mean = total / self.n
        (payload,), sent = self.codec.encode_chunks(mean, [len(mean)])
        self.residual.keep(lo, total - self.n * sent)
        return payload, sent

    def finish(self, pending: Pending):
        """Wait for the mean started as `pending`. Returns (mean float32 (m,), the number of
        workers that voted to stop)."""
        if pending.handle is not None:
            total = yield Wait(pending.handle)
            return total[:-1].div_(self.n), round(total[-1].item())
        yield from self.reduce(pending)
        parts = chunks(pending.m, self.n)
        payloads, votes = [], pending.votes
        for j in self.peers:
            message = yield Recv(MEAN_GATHER, j)
            assert message.step == pending.seq, f"mean {pending.seq}: rank {j} sent mean {message.step}"
            payloads.append(message.tensor)
            votes = message.aux
        if not payloads:  # one worker: its mean is its own
            return pending.mine, votes
        theirs = self.codec.decode_chunks(payloads, [b - a for j, (a, b) in enumerate(parts) if j != self.rank])
        a, b = parts[self.rank]
        return torch.cat([theirs[:a], pending.mine, theirs[a:]]), votes
