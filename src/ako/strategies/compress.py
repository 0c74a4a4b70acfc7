"""Compressed exchange (`--compress`): a float32 vector as bf16, int8 or fp4 bytes on the wire,
decoded back to float32 before any sum (accumulation stays in float32), and the error feedback
that keeps what a lossy code did not send.

Codes (each `Codec` turns x, float32 (m,), into a uint8 payload and back):
- `none`: the float32 bytes themselves (4 bytes a value).
- `bf16`: round to nearest bfloat16 (2 bytes a value); |x - x'| <= |x| * 2^-8.
- `int8`: blocks of BLOCK values, each with a float32 scale absmax / 127 and the values rounded
  to the nearest multiple of it (1 + 4/BLOCK bytes a value; INTELLECT-1's int8 all-reduce,
  Jaghouar et al., arXiv 2412.01152); |x - x'| <= absmax(block) / 254.
- `fp4`: blocks of BLOCK values, each with a float32 scale absmax and every value as a sign
  and a 3-bit exponent, no mantissa (E3M0: 0 or +-2^-6 ... 2^0 times the scale), two values a
  byte (0.5 + 4/BLOCK bytes a value), as Streaming DiLoCo sends its outer gradients (Douillard
  et al., arXiv 2501.18512, sec. 2.3); |x - x'| <= max(|x| / 3, absmax(block) x 2^-7).

Error feedback (Seide et al., "1-bit SGD", Interspeech 2014; Karimireddy et al., ICML 2019):
`Residual` keeps e, what the code left out; the next exchange of those coordinates sends
x + e, so nothing is lost, only late: the values sent plus the residual equal the values given.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

BLOCK = 128  # values sharing one float32 scale (int8, fp4)
COMPRESSIONS = ("none", "bf16", "int8", "fp4")  # --compress
_E3M0 = torch.tensor([0.0] + [2.0**e for e in range(-6, 1)])  # fp4's magnitudes, times the block's absmax
_E3M0_MIDPOINTS = (_E3M0[1:] + _E3M0[:-1]) / 2


class Codec:
    """`none`: float32 as it is. Subclasses encode lossily; `lossy` says whether they do.

    `encode_chunks` and `decode_chunks` do the same for the consecutive chunks of a vector
    (a compressed mean's n chunks, `mean.py`) in a few tensor operations, where a loop over
    the chunks would cost more than the coding itself; each chunk's payload is exactly its
    `encode`'s."""

    name = "none"
    lossy = False

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The payload of x (float32 (m,)): a flat tensor, here x itself (not to be modified)."""
        return x

    def decode(self, payload: torch.Tensor, m: int) -> torch.Tensor:
        """x' (float32 (m,)) from a payload of m values."""
        return payload

    def nbytes(self, m: int) -> int:
        """Bytes of the payload of m values."""
        return 4 * m

    def encode_chunks(self, x: torch.Tensor, sizes: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The payloads of x's consecutive chunks of `sizes` values (x float32 (sum(sizes),)),
        and what they decode to, float32 (sum(sizes),)."""
        payloads = [self.encode(chunk) for chunk in x.split(sizes)]
        return payloads, self.decode_chunks(payloads, sizes)

    def decode_chunks(self, payloads: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
        """The chunks of `sizes` values decoded from their payloads, one after the other,
        float32 (sum(sizes),)."""
        return torch.cat([self.decode(payload, m) for payload, m in zip(payloads, sizes)])


class BFloat16(Codec):
    name, lossy = "bf16", True

    def encode(self, x):
        return x.to(torch.bfloat16).view(torch.uint8)

    def decode(self, payload, m):
        return payload.view(torch.bfloat16).float()

    def nbytes(self, m):
        return 2 * m

    def encode_chunks(self, x, sizes):
        coded = self.encode(x)
        return list(coded.split([2 * m for m in sizes])), self.decode(coded, len(x))

    def decode_chunks(self, payloads, sizes):
        return self.decode(torch.cat(payloads), sum(sizes))


class _BlockCodec(Codec):
    """A code of blocks of BLOCK values, each with a float32 scale: a payload is the scales of
    its ceil(m / BLOCK) blocks, then the codes of its m values (`code_bytes(m)` bytes). The
    coding works on rows (k, L), L a multiple of BLOCK, each a chunk zero-padded; zeros code to
    zero and leave a block's absmax as it is, so a row's payload is its chunk's alone. Where the
    chunks' values and bytes sit in those rows is one index per list of sizes (`_Layout`)."""

    def _encode_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(scales (k, L / BLOCK) float32, codes (k, code_bytes(L)) uint8) of rows (k, L)."""
        raise NotImplementedError

    def _decode_rows(self, scales: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Rows (k, L) float32 from scales (k, L / BLOCK) and codes (k, code_bytes(L))."""
        raise NotImplementedError

    def code_bytes(self, m: int) -> int:
        raise NotImplementedError

    def nbytes(self, m):
        return 4 * -(-m // BLOCK) + self.code_bytes(m)

    def encode(self, x):
        return self.encode_chunks(x, [len(x)])[0][0]

    def decode(self, payload, m):
        return self.decode_chunks([payload], [m])

    def encode_chunks(self, x, sizes):
        layout = _layout(self, tuple(sizes), x.device)
        rows = x.new_zeros(layout.k * layout.width)
        rows[layout.values] = x
        scales, codes = self._encode_rows(rows.view(layout.k, layout.width))
        wire = torch.cat([scales.view(torch.uint8).view(-1), codes.view(-1)])[layout.bytes]
        return list(wire.split(layout.nbytes)), self._decode_rows(scales, codes).view(-1)[layout.values]

    def decode_chunks(self, payloads, sizes):
        layout = _layout(self, tuple(sizes), payloads[0].device if payloads else torch.device("cpu"))
        wire = payloads[0].new_zeros(layout.k * (4 * layout.width // BLOCK + self.code_bytes(layout.width)))
        wire[layout.bytes] = torch.cat(payloads) if payloads else wire[:0]
        scales, codes = wire.split([4 * layout.k * layout.width // BLOCK, layout.k * self.code_bytes(layout.width)])
        rows = self._decode_rows(scales.view(torch.float32).view(layout.k, -1), codes.view(layout.k, -1))
        return rows.view(-1)[layout.values]


@dataclass(frozen=True)
class _Layout:
    """Chunks of `sizes` values as k rows of `width` (a multiple of BLOCK): `values`, the
    chunks' values' places in the rows (flat); `bytes`, the payloads' bytes' places in the
    rows' scales (k x width / BLOCK float32) then codes (k x code_bytes(width)), payload after
    payload; `nbytes`, each payload's length."""

    k: int
    width: int
    values: torch.Tensor
    bytes: torch.Tensor
    nbytes: list[int]


@functools.lru_cache(maxsize=256)  # a run codes the same few lists of sizes every step
def _layout(codec: _BlockCodec, sizes: tuple[int, ...], device: torch.device) -> _Layout:
    k, width = len(sizes), max(BLOCK, -(-max(sizes, default=0) // BLOCK) * BLOCK)
    blocks, row_code = width // BLOCK, codec.code_bytes(width)
    values, places = [], []
    for j, m in enumerate(sizes):
        values.append(torch.arange(m) + j * width)
        places.append(torch.arange(4 * -(-m // BLOCK)) + 4 * j * blocks)
        places.append(torch.arange(codec.code_bytes(m)) + 4 * k * blocks + j * row_code)
    as_index = lambda parts: torch.cat(parts).to(device) if parts else torch.zeros(0, dtype=torch.int64, device=device)  # noqa: E731
    return _Layout(k, width, as_index(values), as_index(places), [codec.nbytes(m) for m in sizes])


def _absmax(rows: torch.Tensor) -> torch.Tensor:
    """Each block's absmax (k, L / BLOCK) of rows (k, L), 1 where it is 0."""
    absmax = rows.view(rows.shape[0], -1, BLOCK).abs().amax(dim=2)
    return torch.where(absmax > 0, absmax, torch.ones_like(absmax))


class Int8(_BlockCodec):
    name, lossy = "int8", True

    def code_bytes(self, m):
        return m

    def _encode_rows(self, rows):
        scale = _absmax(rows) / 127
        blocks = rows.view(rows.shape[0], -1, BLOCK)
        codes = torch.round(blocks / scale[:, :, None]).clamp_(-127, 127).to(torch.int8)
        return scale, codes.view(rows.shape[0], -1).view(torch.uint8)

    def _decode_rows(self, scales, codes):
        values = codes.view(torch.int8).float().view(codes.shape[0], -1, BLOCK)
        return (values * scales[:, :, None]).view(codes.shape[0], -1)


class FP4(_BlockCodec):
    name, lossy = "fp4", True

    def code_bytes(self, m):
        return (m + 1) // 2

    def _encode_rows(self, rows):
        absmax = _absmax(rows)
        blocks = rows.view(rows.shape[0], -1, BLOCK)
        magnitude = torch.bucketize(blocks.abs() / absmax[:, :, None], _E3M0_MIDPOINTS.to(rows.device))  # nearest level, 0..7
        codes = (magnitude | (blocks < 0).to(torch.int64) << 3).view(rows.shape[0], -1).to(torch.uint8)
        return absmax, codes[:, 0::2] | codes[:, 1::2] << 4

    def _decode_rows(self, scales, codes):
        unpacked = torch.stack([codes & 15, codes >> 4], dim=2).view(codes.shape[0], -1).long()
        values = _E3M0.to(codes.device)[unpacked & 7] * (1 - 2 * (unpacked >> 3)).float()
        return (values.view(codes.shape[0], -1, BLOCK) * scales[:, :, None]).view(codes.shape[0], -1)


CODECS: dict[str, Codec] = {c.name: c for c in (Codec(), BFloat16(), Int8(), FP4())}


class Residual:
    """Error feedback over a flat vector of `numel` values: e (numel,), what earlier encodings
    of each coordinate left out."""

    def __init__(self, codec: Codec, numel: int, device: torch.device | str = "cpu"):
        self.codec = codec
        self.error = torch.zeros(numel, device=device)

    def encode(self, x: torch.Tensor, lo: int, sizes: list[int] | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Encode x + e[lo:lo+m] (x float32 (m,)) in consecutive chunks of `sizes` values (one
        chunk where None); e keeps what the code left out. Returns the chunks' payloads and
        what they decode to (float32 (m,)): decoded + e_new = x + e_old."""
        e = self.error[lo : lo + len(x)]
        y = x + e
        payloads, sent = self.codec.encode_chunks(y, [len(x)] if sizes is None else sizes)
        e.copy_(y - sent)
        return payloads, sent

    def keep(self, lo: int, left_out: torch.Tensor) -> None:
        """Add `left_out` (m,) to e[lo:lo+m]: a value this worker owes the others."""
        self.error[lo : lo + len(left_out)].add_(left_out)
