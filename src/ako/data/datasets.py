"""Data sets by name: locate the files, load, subset and normalise them.

Every data set is returned as a :class:`DataSplit` of two ``TensorDataset``s holding
x float32 ``(N, 1, H, W)`` and y int64 ``(N,)``. Pixels are standardised as
``x = (pixel / scale - mean) / std`` where ``scale`` is the largest pixel value of the format
(255 for IDX, 16 for digits) and ``mean``/``std`` are scalars computed over the training images
actually returned (i.e. after ``train_samples`` subsetting); the test images use the same
``mean``/``std``, so no test statistics leak into training.
"""

from __future__ import annotations

import importlib.util

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from ako.data.errors import DataError
from ako.data.idx import read_idx_pair
from ako.data.text import Vocabulary, is_text, load_text

DATASETS = ("fashion-mnist", "mnist", "digits", "auto", "fortunes")  # and text:PATH

DEFAULT_DIRS = {
    "fashion-mnist": "/usr/share/datasets/fashion-mnist",
    "mnist": "/usr/share/datasets/mnist",
}

ENV_VAR = "AKO_DATA_DIR"

IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}

IDX_NUM_CLASSES = 10
IDX_SCALE = 255

DIGITS_SOURCE = "scikit-learn bundled digits"
DIGITS_TRAIN = 1497  # of 1797; the remaining 300 are the test set
DIGITS_SEED = 0
DIGITS_SCALE = 16


@dataclass(frozen=True)
class DataSplit:
    """A loaded data set.

    Attributes:
        name: the data set actually loaded ("fashion-mnist", "mnist" or "digits"; never "auto").
        train: TensorDataset of x float32 ``(N, C, H, W)`` standardised, y int64 ``(N,)``.
        test: the same layout, standardised with the training mean and std.
        input_shape: ``(C, H, W)`` of one example.
        num_classes: labels are in ``0 .. num_classes - 1``.
        source: the directory the files came from, or "scikit-learn bundled digits".
        notice: for "auto" when it fell back to digits, a one-line explanation; else None.
        standardisation: (mean, std) in pixel units (0..255 for IDX, 0..16 for digits): a
            sample is ``(pixel - mean) / std``; None for text.
        vocabulary: a text data set's (`ako.data.text`), whose samples are sequences of
            token ids (``input_shape`` (context,), ``num_classes`` the vocabulary's size).
    """

    name: str
    train: TensorDataset
    test: TensorDataset
    input_shape: tuple[int, int, int]
    num_classes: int
    source: str
    notice: str | None = None
    standardisation: tuple[float, float] | None = (0.0, 1.0)
    vocabulary: Vocabulary | None = None


@dataclass(frozen=True)
class _Raw:
    """Unnormalised uint8 pixels ``(N, H, W)`` and uint8/int labels ``(N,)`` of both splits."""

    train_pixels: np.ndarray
    train_labels: np.ndarray
    test_pixels: np.ndarray
    test_labels: np.ndarray
    scale: int
    num_classes: int
    source: str


def find_data_dir(name: str, data_dir: str | os.PathLike | None = None) -> Path | None:
    """Find the directory holding the four IDX files of ``name`` ("fashion-mnist" or "mnist").

    With ``data_dir`` only that directory (and its subfolder ``<data_dir>/<name>``) is
    searched. Without it, ``$AKO_DATA_DIR`` (and ``$AKO_DATA_DIR/<name>``) then
    ``DEFAULT_DIRS[name]`` are searched in that order; a ``$AKO_DATA_DIR`` that is not a
    directory is a DataError. Each of the files
    train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and
    t10k-labels-idx1-ubyte may be plain or end in ``.gz``.

    Returns:
        The first directory that has all four files, or None.

    Raises:
        DataError: ``name`` is not an IDX data set; ``$AKO_DATA_DIR`` is set to no directory.
    """
    for candidate in _candidates(name, data_dir):
        if _idx_paths(candidate) is not None:
            return candidate
    return None


def load_dataset(
    name: str,
    data_dir: str | os.PathLike | None = None,
    train_samples: int | None = None,
    test_samples: int | None = None,
    context: int = 128,
) -> DataSplit:
    """Load a data set by name: images standardised, as float32 images and int64 labels; text
    ("fortunes", "text:PATH") as sequences of `context` token ids (`ako.data.text.load_text`).

    Args:
        name: one of :data:`DATASETS`. "auto" is fashion-mnist when its files are found, else
            digits with a one-line ``notice``; an explicit ``data_dir`` that lacks the files
            is an error for "auto" too. "digits" reads no files (it is bundled with
            scikit-learn: 1797 8x8 images, permuted with numpy ``RandomState(0)``; the first
            1497 are the training set, the last 300 the test set).
        data_dir: directory with the IDX files (see :func:`find_data_dir`); searched alone.
        train_samples: keep only the first k training examples (1 <= k <= available).
        test_samples: keep only the first k test examples (1 <= k <= available).

    Returns:
        A :class:`DataSplit`.

    Raises:
        DataError: unknown name; files not found (naming the places searched and the file
            names expected); a damaged file; labels out of range; train and test image sizes
            differ; a sample count out of range.
    """
    if is_text(name):
        text = load_text(name, context, train_samples, test_samples)
        return DataSplit(name, text.train, text.test, (context,), text.vocabulary.size, text.source,
                         standardisation=None, vocabulary=text.vocabulary)  # fmt: skip
    if name not in DATASETS:
        raise DataError(f"unknown data set {name!r}: choose one of {', '.join(DATASETS)}, or text:PATH")
    notice = None
    if name == "auto":
        name = "fashion-mnist"
        if data_dir is None and find_data_dir(name) is None:
            notice = (
                f"fashion-mnist not found in {_searched(name, None)}; "
                f"using {DIGITS_SOURCE} (8x8) instead"
            )
            name = "digits"
    raw = _load_digits() if name == "digits" else _load_idx(name, data_dir)
    train_pixels, train_labels = _first(raw.train_pixels, raw.train_labels, train_samples, "train")
    test_pixels, test_labels = _first(raw.test_pixels, raw.test_labels, test_samples, "test")
    mean, std = _pixel_stats(train_pixels)
    channels, height, width = 1, *train_pixels.shape[1:]
    return DataSplit(
        name=name,
        train=TensorDataset(_standardise(train_pixels, mean, std), _labels(train_labels)),
        test=TensorDataset(_standardise(test_pixels, mean, std), _labels(test_labels)),
        input_shape=(channels, height, width),
        num_classes=raw.num_classes,
        source=raw.source,
        notice=notice,
        standardisation=(mean, std),
    )


def _candidates(name: str, data_dir: str | os.PathLike | None) -> list[Path]:
    """Directories to search for ``name``, in order (each also with a ``<name>`` subfolder)."""
    if name not in DEFAULT_DIRS:
        raise DataError(
            f"data set {name!r} has no data directory: IDX data sets are "
            f"{', '.join(DEFAULT_DIRS)}"
        )
    if data_dir is not None:
        roots = [Path(data_dir)]
    else:
        env = os.environ.get(ENV_VAR)
        if env and not os.path.isdir(env):  # a setting that points nowhere is a mistake, not a hint to pass over
            raise DataError(f"${ENV_VAR} {env[:200]!r}: no such directory; set it to the folder of the IDX files "
                            f"(or their <name> subfolders), or unset it to search {DEFAULT_DIRS[name]}")  # fmt: skip
        roots = ([Path(env)] if env else []) + [Path(DEFAULT_DIRS[name])]
    return [path for root in roots for path in (root, root / name)]


def _searched(name: str, data_dir: str | os.PathLike | None) -> str:
    """The places :func:`find_data_dir` looks, for error messages."""
    return ", ".join(str(path) for path in _candidates(name, data_dir))


def _idx_paths(directory: Path) -> dict[str, Path] | None:
    """Map IDX_FILES keys to existing files in ``directory`` (plain preferred), or None."""
    found = {}
    for key, stem in IDX_FILES.items():
        options = [directory / stem, directory / f"{stem}.gz"]
        try:
            existing = [path for path in options if path.is_file()]
        except OSError as e:  # e.g. a name too long for the file system
            raise DataError(f"data directory {str(directory)[:200]!r}: {e.strerror}") from None
        if not existing:
            return None
        found[key] = existing[0]
    return found


def _load_idx(name: str, data_dir: str | os.PathLike | None) -> _Raw:
    """Read the four IDX files of ``name``; validate labels and image sizes."""
    directory = find_data_dir(name, data_dir)
    if directory is None:
        expected = ", ".join(f"{stem}[.gz]" for stem in IDX_FILES.values())
        hint = "" if data_dir is not None else f" (pass --data-dir or set {ENV_VAR})"
        raise DataError(
            f"{name}: data files not found in {_searched(name, data_dir)}; "
            f"expected {expected}{hint}"
        )
    paths = _idx_paths(directory)
    train_pixels, train_labels = read_idx_pair(paths["train_images"], paths["train_labels"])
    test_pixels, test_labels = read_idx_pair(paths["test_images"], paths["test_labels"])
    if len(train_pixels) == 0 or len(test_pixels) == 0:
        empty = paths["train_images"] if len(train_pixels) == 0 else paths["test_images"]
        raise DataError(f"{empty}: has no examples, expected at least 1")
    _check_labels(train_labels, IDX_NUM_CLASSES, paths["train_labels"])
    _check_labels(test_labels, IDX_NUM_CLASSES, paths["test_labels"])
    if train_pixels.shape[1:] != test_pixels.shape[1:]:
        raise DataError(
            f"{paths['test_images']}: images are {_size(test_pixels)}, but training images in "
            f"{paths['train_images']} are {_size(train_pixels)}"
        )
    return _Raw(train_pixels, train_labels, test_pixels, test_labels,
                IDX_SCALE, IDX_NUM_CLASSES, str(directory))


def _load_digits() -> _Raw:
    """scikit-learn's bundled 8x8 digits, split 1497/300 by a fixed permutation."""
    # Read from scikit-learn's file (64 pixels, then the label, per row), as its load_digits
    # does, without importing scikit-learn: that takes 1.4 s, in every worker process.
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("data set 'digits' needs scikit-learn installed (pip install scikit-learn)")
    table = np.loadtxt(Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz",
                       delimiter=",", dtype=np.uint8)  # fmt: skip
    pixels, labels = table[:, :-1].reshape(-1, 8, 8), table[:, -1]
    # Legacy RandomState: its stream is frozen across numpy versions, so the split is too.
    order = np.random.RandomState(DIGITS_SEED).permutation(len(pixels))
    train, test = order[:DIGITS_TRAIN], order[DIGITS_TRAIN:]
    return _Raw(pixels[train], labels[train], pixels[test], labels[test],
                DIGITS_SCALE, 10, DIGITS_SOURCE)


def _check_labels(labels: np.ndarray, num_classes: int, path: Path) -> None:
    """Raise DataError naming ``path`` if any label is >= ``num_classes``."""
    bad = np.flatnonzero(labels >= num_classes)
    if bad.size:
        i = int(bad[0])
        raise DataError(
            f"{path}: label {labels[i]} at index {i} is out of range 0..{num_classes - 1} "
            f"({bad.size} labels out of range)"
        )


def _first(
    pixels: np.ndarray, labels: np.ndarray, k: int | None, split: str
) -> tuple[np.ndarray, np.ndarray]:
    """The first ``k`` examples of a split (all when k is None)."""
    if k is None:
        return pixels, labels
    available = len(pixels)
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= available:
        raise DataError(
            f"{split}_samples={k!r} is out of range: choose an integer from 1 to {available}"
        )
    return pixels[:k], labels[:k]


def _pixel_stats(pixels: np.ndarray) -> tuple[float, float]:
    """Exact mean and population std of uint8 ``pixels``, in pixel units (float64 sums)."""
    flat = pixels.reshape(-1)
    mean = flat.mean(dtype=np.float64)
    mean_square = np.einsum("i,i->", flat, flat, dtype=np.float64) / flat.size
    std = float(np.sqrt(max(mean_square - mean * mean, 0.0)))
    # Constant images (degenerate fixtures) have std 0; dividing by 1 keeps them finite.
    return float(mean), std if std > 0 else 1.0


def _standardise(pixels: np.ndarray, mean: float, std: float) -> torch.Tensor:
    """uint8 ``(N, H, W)`` -> float32 ``(N, 1, H, W)`` as ``(pixel - mean) / std``.

    In pixel units this equals ``(pixel / scale - mean / scale) / (std / scale)``.
    """
    x = torch.from_numpy(pixels).to(torch.float32)
    return x.sub_(mean).div_(std).unsqueeze(1)


def _labels(labels: np.ndarray) -> torch.Tensor:
    """uint8 ``(N,)`` -> int64 ``(N,)``."""
    return torch.from_numpy(labels).to(torch.int64)


def _size(pixels: np.ndarray) -> str:
    """'HxW' of an image stack, for messages."""
    return "x".join(map(str, pixels.shape[1:]))
