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

import torch

BLOCK = 128  # values sharing one float32 scale (int8, fp4)
COMPRESSIONS = ("none", "bf16", "int8", "fp4")  # --compress
_E3M0 = torch.tensor([0.0] + [2.0**e for e in range(-6, 1)])  # fp4's magnitudes, times the block's absmax
_E3M0_MIDPOINTS = (_E3M0[1:] + _E3M0[:-1]) / 2


class Codec:
    """`none`: float32 as it is. Subclasses encode lossily; `lossy` says whether they do."""

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


class BFloat16(Codec):
    name, lossy = "bf16", True

    def encode(self, x):
        return x.to(torch.bfloat16).view(torch.uint8)

    def decode(self, payload, m):
        return payload.view(torch.bfloat16).float()

    def nbytes(self, m):
        return 2 * m


def _blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (m,) as (blocks, BLOCK) zero-padded, and each block's absmax (blocks,), 1 where 0."""
    pad = -len(x) % BLOCK
    blocks = torch.nn.functional.pad(x, (0, pad)).view(-1, BLOCK)
    absmax = blocks.abs().amax(dim=1)
    return blocks, torch.where(absmax > 0, absmax, torch.ones_like(absmax))


def _scales_and_codes(payload: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    nblocks = -(-m // BLOCK)
    return payload[: 4 * nblocks].view(torch.float32), payload[4 * nblocks :]


class Int8(Codec):
    name, lossy = "int8", True

    def encode(self, x):
        blocks, absmax = _blocks(x)
        scale = absmax / 127
        codes = torch.round(blocks / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return torch.cat([scale.view(torch.uint8), codes.view(-1)[: len(x)].view(torch.uint8)])

    def decode(self, payload, m):
        scale, codes = _scales_and_codes(payload, m)
        values = torch.nn.functional.pad(codes.view(torch.int8).float(), (0, -m % BLOCK)).view(-1, BLOCK)
        return (values * scale[:, None]).view(-1)[:m]

    def nbytes(self, m):
        return 4 * -(-m // BLOCK) + m


class FP4(Codec):
    name, lossy = "fp4", True

    def encode(self, x):
        blocks, absmax = _blocks(x)
        magnitude = torch.bucketize(blocks.abs() / absmax[:, None], _E3M0_MIDPOINTS.to(x.device))  # nearest level, 0..7
        codes = (magnitude | (blocks < 0).to(torch.int64) << 3).view(-1)[: len(x)].to(torch.uint8)
        codes = torch.nn.functional.pad(codes, (0, len(codes) % 2))
        return torch.cat([absmax.view(torch.uint8), codes[0::2] | codes[1::2] << 4])

    def decode(self, payload, m):
        absmax, packed = _scales_and_codes(payload, m)
        codes = torch.stack([packed & 15, packed >> 4], dim=1).view(-1)[:m].long()
        values = _E3M0.to(payload.device)[codes & 7] * (1 - 2 * (codes >> 3)).float()
        return (torch.nn.functional.pad(values, (0, -m % BLOCK)).view(-1, BLOCK) * absmax[:, None]).view(-1)[:m]

    def nbytes(self, m):
        return 4 * -(-m // BLOCK) + (m + 1) // 2


CODECS: dict[str, Codec] = {c.name: c for c in (Codec(), BFloat16(), Int8(), FP4())}


class Residual:
    """Error feedback over a flat vector of `numel` values: e (numel,), what earlier encodings
    of each coordinate left out."""

    def __init__(self, codec: Codec, numel: int, device: torch.device | str = "cpu"):
        self.codec = codec
        self.error = torch.zeros(numel, device=device)

    def encode(self, x: torch.Tensor, lo: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode x + e[lo:lo+m] (x float32 (m,)); e keeps what the code left out. Returns the
        payload and what it decodes to (float32 (m,)): decoded + e_new = x + e_old."""
        e = self.error[lo : lo + len(x)]
        y = x + e
        payload = self.codec.encode(y)
        sent = self.codec.decode(payload, len(y))
        e.copy_(y - sent)
        return payload, sent

    def keep(self, lo: int, left_out: torch.Tensor) -> None:
        """Add `left_out` (m,) to e[lo:lo+m]: a value this worker owes the others."""
        self.error[lo : lo + len(left_out)].add_(left_out)
