"""Reader and writer for the IDX format of MNIST and Fashion-MNIST.

Layout (http://yann.lecun.com/exdb/mnist/): two zero bytes, a data type code (only 0x08,
unsigned byte, is accepted), the number of dimensions, one big-endian uint32 per dimension,
then the data in C order. Files may be gzip-compressed; compression is detected from the
gzip magic bytes, not from the file name.
"""

from __future__ import annotations

import gzip
import math
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from ako.data.errors import DataError

_GZIP_MAGIC = b"\x1f\x8b"
_UINT8_CODE = 0x08


def read_idx(path: str | os.PathLike, expect_ndim: int) -> np.ndarray:
    """Read one uint8 IDX file, plain or gzip-compressed.

    Args:
        path: the file.
        expect_ndim: the number of dimensions the caller needs (3 for images, 1 for labels).

    Returns:
        A writable, C-contiguous uint8 array with the shape given in the file header.

    Raises:
        DataError: the file is missing or unreadable, the gzip stream is corrupt, the magic
            number or data type code is wrong, the number of dimensions is not
            ``expect_ndim``, or the data is shorter ("truncated") or longer ("trailing
            bytes") than the header says.
    """
    payload = _payload(path)
    shape, offset = _parse_header(payload, path, expect_ndim)
    expected = math.prod(shape)
    got = len(payload) - offset
    described = f"header says {'x'.join(map(str, shape))} = {expected} bytes of data"
    if got < expected:
        raise DataError(f"{path}: truncated: {described}, file has {got}")
    if got > expected:
        raise DataError(f"{path}: trailing bytes: {described}, file has {got}")
    # np.frombuffer over bytes is read-only, and torch.from_numpy warns about that.
    return np.frombuffer(payload, np.uint8, count=expected, offset=offset).reshape(shape).copy()


def read_idx_pair(
    images_path: str | os.PathLike, labels_path: str | os.PathLike
) -> tuple[np.ndarray, np.ndarray]:
    """Read an images file and its labels file.

    Returns:
        ``(images, labels)``: images uint8 ``(N, H, W)``, labels uint8 ``(N,)``.

    Raises:
        DataError: either file fails :func:`read_idx`, or the two counts N differ.
    """
    images = read_idx(images_path, expect_ndim=3)
    labels = read_idx(labels_path, expect_ndim=1)
    if len(images) != len(labels):
        raise DataError(
            f"{images_path}, {labels_path}: mismatched counts: images file has "
            f"{len(images)}, labels file has {len(labels)}"
        )
    return images, labels


def write_idx(path: str | os.PathLike, array: np.ndarray, gz: bool) -> None:
    """Write a uint8 array as an IDX file (for fixtures and benchmarks).

    Args:
        path: the file to create or overwrite.
        array: uint8 array with 1 to 255 dimensions.
        gz: gzip-compress the file.

    Raises:
        ValueError: the array is not uint8 or has no dimensions.
    """
    array = np.asarray(array)
    if array.dtype != np.uint8 or array.ndim == 0:
        raise ValueError(
            f"write_idx needs a uint8 array with at least one dimension, "
            f"got {array.dtype} with shape {array.shape}"
        )
    header = struct.pack(f">BBBB{array.ndim}I", 0, 0, _UINT8_CODE, array.ndim, *array.shape)
    opener = gzip.open if gz else open
    with opener(path, "wb") as f:
        f.write(header)
        f.write(np.ascontiguousarray(array).tobytes())


def _payload(path: str | os.PathLike) -> bytes:
    """The file's bytes, gunzipped if they start with the gzip magic number."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError as exc:
        raise DataError(f"{path}: no such file") from exc
    except OSError as exc:
        raise DataError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    if raw[:2] != _GZIP_MAGIC:
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        # BadGzipFile is an OSError; a stream cut short is an EOFError.
        raise DataError(f"{path}: corrupt gzip stream: {exc}") from exc


def _parse_header(
    payload: bytes, path: str | os.PathLike, expect_ndim: int
) -> tuple[tuple[int, ...], int]:
    """Validate the IDX header; return the shape it declares and the data offset in bytes."""
    if len(payload) < 4:
        raise DataError(
            f"{path}: truncated: {len(payload)} bytes, an IDX header needs at least 4"
        )
    if payload[:2] != b"\0\0":
        raise DataError(
            f"{path}: not an IDX file: magic number starts with 0x{payload[:2].hex()}, "
            f"expected 0x0000"
        )
    if payload[2] != _UINT8_CODE:
        raise DataError(
            f"{path}: unsupported IDX data type code 0x{payload[2]:02x}: "
            f"only 0x{_UINT8_CODE:02x} (unsigned byte) is supported"
        )
    ndim = payload[3]
    if ndim != expect_ndim:
        raise DataError(f"{path}: has {ndim} dimensions, expected {expect_ndim}")
    offset = 4 + 4 * ndim
    if len(payload) < offset:
        raise DataError(f"{path}: truncated: header declares {ndim} dimensions but ends early")
    shape = struct.unpack_from(f">{ndim}I", payload, 4)
    if 0 in shape[1:]:
        raise DataError(f"{path}: an example has shape {shape[1:]}; every dimension must be at least 1")
    return shape, offset
