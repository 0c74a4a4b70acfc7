"""`MNIST(root, train, download, transform)`: Fashion-MNIST's IDX files in MNIST's place."""

import os

import torch

from ako.data import find_data_dir, read_idx_pair


class MNIST(torch.utils.data.Dataset):
    def __init__(self, root, train=True, download=False, transform=None):
        where = find_data_dir("fashion-mnist")
        prefix = "train" if train else "t10k"
        images, labels = read_idx_pair(os.path.join(where, f"{prefix}-images-idx3-ubyte.gz"),
                                       os.path.join(where, f"{prefix}-labels-idx1-ubyte.gz"))  # fmt: skip
        keep = int(os.environ.get("STUB_MNIST_SAMPLES", len(labels)))
        self.images, self.labels, self.transform = images[:keep], torch.from_numpy(labels[:keep]).long(), transform

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        image = self.images[i]
        return (self.transform(image) if self.transform else image), self.labels[i]
