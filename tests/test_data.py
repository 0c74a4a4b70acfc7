"""Tests for ako.data: the IDX reader and data set loading (shards and fetch: test_sampler.py)."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch

from ako.data import (
    DATASETS,
    DataError,
    find_data_dir,
    load_dataset,
    read_idx,
    read_idx_pair,
    write_idx,
)
from ako.data import datasets as datasets_module

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
IDX_NAMES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


def _images(n: int, seed: int = 0, size: int = 28) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size, size), dtype=np.uint8)


def _write_fixture(directory: Path, n_train: int = 40, n_test: int = 10, gz: bool = True) -> Path:
    """Four small IDX files (labels cycle 0..9) in ``directory``; returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    suffix = ".gz" if gz else ""
    arrays = (
        _images(n_train, seed=1),
        (np.arange(n_train) % 10).astype(np.uint8),
        _images(n_test, seed=2),
        (np.arange(n_test) % 10).astype(np.uint8),
    )
    for name, array in zip(IDX_NAMES, arrays):
        write_idx(directory / f"{name}{suffix}", array, gz=gz)
    return directory


@pytest.fixture
def no_env_dir(monkeypatch):
    monkeypatch.delenv("AKO_DATA_DIR", raising=False)


# --- IDX reader -------------------------------------------------------------------------------


@pytest.mark.parametrize("gz", [True, False])
@pytest.mark.parametrize("shape", [(7, 5, 3), (11,)])
def test_idx_round_trip(tmp_path, gz, shape):
    array = np.random.default_rng(3).integers(0, 256, shape, dtype=np.uint8)
    path = tmp_path / "a.idx"  # no .gz suffix either way: detection is by magic bytes
    write_idx(path, array, gz=gz)
    assert (path.read_bytes()[:2] == b"\x1f\x8b") == gz
    back = read_idx(path, expect_ndim=len(shape))
    assert back.dtype == np.uint8
    assert back.flags.writeable
    np.testing.assert_array_equal(back, array)


def test_read_idx_pair(tmp_path):
    images, labels = _images(6), np.arange(6, dtype=np.uint8)
    write_idx(tmp_path / "i", images, gz=True)
    write_idx(tmp_path / "l", labels, gz=False)
    got_images, got_labels = read_idx_pair(tmp_path / "i", tmp_path / "l")
    np.testing.assert_array_equal(got_images, images)
    np.testing.assert_array_equal(got_labels, labels)


def _header(ndim_dims, code=0x08, magic=b"\0\0"):
    dims = b"".join(int(d).to_bytes(4, "big") for d in ndim_dims)
    return magic + bytes([code, len(ndim_dims)]) + dims


@pytest.mark.parametrize(
    "content, ndim, fragment",
    [
        (_header((4, 2, 2)) + bytes(15), 3, "truncated"),
        (_header((4, 2, 2)) + bytes(17), 3, "trailing bytes"),
        (_header((4, 2, 2), magic=b"\x01\x00") + bytes(16), 3, "not an IDX file"),
        (_header((4, 2, 2), code=0x0D) + bytes(16), 3, "data type code 0x0d"),
        (_header((16,)) + bytes(16), 3, "has 1 dimensions, expected 3"),
        (_header((4, 2, 2))[:9], 3, "truncated"),
        (b"\0\0", 3, "truncated"),
    ],
)
@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_rejects(tmp_path, content, ndim, fragment, gz):
    path = tmp_path / "bad-file-idx"
    path.write_bytes(gzip.compress(content) if gz else content)
    with pytest.raises(DataError, match=fragment) as info:
        read_idx(path, expect_ndim=ndim)
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)


def test_truncated_message_gives_sizes(tmp_path):
    path = tmp_path / "short"
    path.write_bytes(_header((60, 28, 28)) + bytes(1000))
    with pytest.raises(DataError) as info:
        read_idx(path, expect_ndim=3)
    assert str(info.value) == (
        f"{path}: truncated: header says 60x28x28 = 47040 bytes of data, file has 1000"
    )


@pytest.mark.parametrize("cut", ["flip", "short"])
def test_read_idx_rejects_corrupt_gzip(tmp_path, cut):
    data = bytearray(gzip.compress(_header((50, 4, 4)) + _images(50, size=4).tobytes()))
    if cut == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    path = tmp_path / "corrupt.gz"
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match="corrupt gzip") as info:
        read_idx(path, expect_ndim=3)
    assert str(path) in str(info.value)


def test_read_idx_missing_file(tmp_path):
    path = tmp_path / "nope-idx3-ubyte"
    with pytest.raises(DataError, match="no such file") as info:
        read_idx(path, expect_ndim=3)
    assert str(path) in str(info.value)


def test_read_idx_pair_mismatched_counts(tmp_path):
    write_idx(tmp_path / "images", _images(5), gz=False)
    write_idx(tmp_path / "labels", np.zeros(4, np.uint8), gz=True)
    with pytest.raises(DataError) as info:
        read_idx_pair(tmp_path / "images", tmp_path / "labels")
    message = str(info.value)
    assert "mismatched counts: images file has 5, labels file has 4" in message
    assert str(tmp_path / "images") in message and str(tmp_path / "labels") in message


def test_write_idx_rejects_non_uint8(tmp_path):
    with pytest.raises(ValueError, match="uint8"):
        write_idx(tmp_path / "x", np.zeros(3, np.int32), gz=False)


# --- data sets --------------------------------------------------------------------------------


def _check_fixture_split(split, n_train=40, n_test=10):
    x, y = split.train.tensors
    x_test, y_test = split.test.tensors
    assert split.name == "fashion-mnist"
    assert x.shape == (n_train, 1, 28, 28) and x.dtype == torch.float32
    assert y.shape == (n_train,) and y.dtype == torch.int64
    assert x_test.shape == (n_test, 1, 28, 28) and x_test.dtype == torch.float32
    assert y_test.shape == (n_test,) and y_test.dtype == torch.int64
    assert split.input_shape == (1, 28, 28)
    assert split.num_classes == 10
    assert split.notice is None
    assert abs(x.double().mean().item()) < 1e-4
    assert abs(x.double().std(correction=0).item() - 1) < 1e-4
    assert torch.equal(y, torch.arange(n_train) % 10)
    assert torch.equal(y_test, torch.arange(n_test) % 10)


@pytest.mark.parametrize("gz", [True, False])
def test_load_fixture_via_data_dir(tmp_path, no_env_dir, gz):
    directory = _write_fixture(tmp_path / "fm", gz=gz)
    split = load_dataset("fashion-mnist", data_dir=directory)
    _check_fixture_split(split)
    assert split.source == str(directory)
    # Test pixels use the training mean/std: recompute one by hand.
    raw = _images(40, seed=1).astype(np.float64)
    expected = (_images(10, seed=2)[0, 0, 0] - raw.mean()) / raw.std()
    assert split.test.tensors[0][0, 0, 0, 0].item() == pytest.approx(expected, rel=1e-5)


def test_load_fixture_via_env_subfolder(tmp_path, monkeypatch):
    _write_fixture(tmp_path / "fashion-mnist")
    monkeypatch.setenv("AKO_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(datasets_module, "DEFAULT_DIRS", {"fashion-mnist": "/nonexistent"})
    assert find_data_dir("fashion-mnist") == tmp_path / "fashion-mnist"
    _check_fixture_split(load_dataset("fashion-mnist"))


def test_env_dir_without_files_falls_back_to_default(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    default = _write_fixture(tmp_path / "default")
    monkeypatch.setenv("AKO_DATA_DIR", str(empty))
    monkeypatch.setattr(datasets_module, "DEFAULT_DIRS", {"fashion-mnist": str(default)})
    assert find_data_dir("fashion-mnist") == default


def test_subsetting_takes_first_examples(tmp_path, no_env_dir):
    directory = _write_fixture(tmp_path)
    split = load_dataset("fashion-mnist", data_dir=directory, train_samples=20, test_samples=3)
    _check_fixture_split(split, n_train=20, n_test=3)


@pytest.mark.parametrize("train, test, fragment", [
    (0, None, "train_samples=0"),
    (41, None, "train_samples=41"),
    (None, 11, "test_samples=11"),
    (None, -1, "test_samples=-1"),
    (2.5, None, "train_samples=2.5"),
])
def test_bad_sample_counts(tmp_path, no_env_dir, train, test, fragment):
    directory = _write_fixture(tmp_path)
    with pytest.raises(DataError, match=fragment) as info:
        load_dataset("fashion-mnist", data_dir=directory, train_samples=train, test_samples=test)
    assert "from 1 to" in str(info.value)


def test_explicit_dir_without_files(tmp_path, monkeypatch):
    # Even with the files reachable through AKO_DATA_DIR, an explicit directory is used alone.
    _write_fixture(tmp_path / "elsewhere")
    monkeypatch.setenv("AKO_DATA_DIR", str(tmp_path / "elsewhere"))
    empty = tmp_path / "empty"
    empty.mkdir()
    for name in ("fashion-mnist", "auto"):
        with pytest.raises(DataError) as info:
            load_dataset(name, data_dir=empty)
        message = str(info.value)
        assert str(empty) in message
        assert all(f in message for f in IDX_NAMES)


def test_unknown_name():
    with pytest.raises(DataError) as info:
        load_dataset("foo")
    assert str(info.value) == (
        "unknown data set 'foo': choose one of fashion-mnist, mnist, digits, auto, fortunes, or text:PATH"
    )
    assert DATASETS == ("fashion-mnist", "mnist", "digits", "auto", "fortunes")


def test_label_out_of_range(tmp_path, no_env_dir):
    directory = _write_fixture(tmp_path, gz=False)
    write_idx(directory / IDX_NAMES[1], np.full(40, 10, np.uint8), gz=False)
    with pytest.raises(DataError, match="label 10 at index 0") as info:
        load_dataset("fashion-mnist", data_dir=directory)
    assert IDX_NAMES[1] in str(info.value)


def test_damaged_file_in_data_set(tmp_path, no_env_dir):
    directory = _write_fixture(tmp_path, gz=False)
    (directory / IDX_NAMES[2]).write_bytes(_header((10, 28, 28)) + bytes(5))
    with pytest.raises(DataError, match="truncated") as info:
        load_dataset("fashion-mnist", data_dir=directory)
    assert IDX_NAMES[2] in str(info.value)


def test_auto_falls_back_to_digits(tmp_path, monkeypatch):
    monkeypatch.setenv("AKO_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(datasets_module, "DEFAULT_DIRS", {"fashion-mnist": str(tmp_path / "no")})
    split = load_dataset("auto")
    assert split.name == "digits"
    assert split.notice and "digits" in split.notice and "\n" not in split.notice
    assert str(tmp_path) in split.notice
    assert split.source == "scikit-learn bundled digits"
    assert split.input_shape == (1, 8, 8)
    assert split.num_classes == 10
    x, y = split.train.tensors
    x_test, y_test = split.test.tensors
    assert x.shape == (1497, 1, 8, 8) and x_test.shape == (300, 1, 8, 8)
    assert y.dtype == torch.int64 and set(y.tolist()) == set(range(10))
    assert abs(x.double().mean().item()) < 1e-4
    assert abs(x.double().std(correction=0).item() - 1) < 1e-4
    # Deterministic split: the same data on a second load; no test image is in the train set.
    again = load_dataset("digits")
    assert again.notice is None
    assert torch.equal(again.train.tensors[0], x) and torch.equal(again.test.tensors[1], y_test)
    train_rows = {tuple(r) for r in x.flatten(1).tolist()}
    test_rows = [tuple(r) for r in x_test.flatten(1).tolist()]
    assert not any(r in train_rows for r in test_rows)


def test_auto_uses_fashion_mnist_when_found(tmp_path, monkeypatch):
    _write_fixture(tmp_path)
    monkeypatch.setenv("AKO_DATA_DIR", str(tmp_path))
    split = load_dataset("auto")
    assert split.name == "fashion-mnist" and split.notice is None
    assert split.source == str(tmp_path)


@pytest.fixture(scope="module")
def real_fashion_mnist():
    assert FASHION_DIR.is_dir(), (
        f"{FASHION_DIR} is missing: install Debian's dataset-fashion-mnist package "
        f"(apt-get install dataset-fashion-mnist)"
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("AKO_DATA_DIR", raising=False)
        return load_dataset("fashion-mnist")


def test_real_fashion_mnist(real_fashion_mnist):
    split = real_fashion_mnist
    x, y = split.train.tensors
    x_test, y_test = split.test.tensors
    assert split.source == str(FASHION_DIR)
    assert x.shape == (60000, 1, 28, 28) and x_test.shape == (10000, 1, 28, 28)
    assert split.input_shape == (1, 28, 28) and split.num_classes == 10
    assert torch.equal(torch.bincount(y, minlength=10), torch.full((10,), 6000))
    assert torch.equal(torch.bincount(y_test, minlength=10), torch.full((10,), 1000))
    std, mean = torch.std_mean(x, correction=0)
    assert abs(mean.item()) < 1e-4 and abs(std.item() - 1) < 1e-4
