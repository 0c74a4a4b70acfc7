"""Data sets (IDX reader for Fashion-MNIST/MNIST, bundled digits), sharding and batching."""

from ako.data.datasets import DATASETS, DataSplit, find_data_dir, load_dataset
from ako.data.errors import DataError
from ako.data.idx import read_idx, read_idx_pair, write_idx
from ako.data.sampler import ShardSampler, fetch, to_device

__all__ = [
    "DATASETS",
    "DataError",
    "DataSplit",
    "ShardSampler",
    "fetch",
    "to_device",
    "find_data_dir",
    "load_dataset",
    "read_idx",
    "read_idx_pair",
    "write_idx",
]
