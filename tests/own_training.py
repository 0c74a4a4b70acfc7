"""A user's own training pieces, importable by name (`--model own_training:digits_net`): a
model with BatchNorm, a model that returns a dict, a data set factory, losses, metrics, and
factories that fail."""

from __future__ import annotations

import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ako.data import load_dataset
from ako.replica import classification_metrics


def digits_net() -> nn.Module:
    """A small network for 8x8 digits with a BatchNorm layer (buffers a model file must keep)."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 64, 10),
    )  # fmt: skip


class DictNet(nn.Module):
    """A model whose forward takes a dict batch and returns a dict, as many real models do."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, batch: dict) -> dict:
        return {"logits": self.body(batch["image"])}


def dict_collate(samples: list) -> dict:
    """(x, label) samples as a dict batch: {"image": (B, 1, 8, 8), "label": (B,)}."""
    return {"image": torch.stack([x for x, _ in samples]), "label": torch.stack([y for _, y in samples])}


def dict_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.cross_entropy(model(batch)["logits"], batch["label"])


def dict_metrics(model: nn.Module, batch: dict) -> dict:
    logits = model(batch)["logits"]
    return {"loss": F.cross_entropy(logits, batch["label"]).item(), "error": (logits.argmax(1) != batch["label"]).float().mean().item()}


def digits_sets():
    """A data set factory: (train, test) of digits, 384 and 60 samples."""
    split = load_dataset("digits", train_samples=384, test_samples=60)
    return split.train, split.test


def slow_on_rank_1() -> nn.Module:
    """`digits_net`, built 3 s late by rank 1 (a rank that loads or builds slowly on a busy machine)."""
    if os.environ.get("RANK") == "1":
        time.sleep(3.0)
    return digits_net()


def broken_net() -> nn.Module:
    raise RuntimeError("no weights here")


def not_a_module():
    return 42


class _SlowInLoader(torch.utils.data.Dataset):
    """Digits whose samples take 30 s each in a DataLoader process (a stuck loader), at once here."""

    def __init__(self, tensors):
        self.tensors = tensors

    def __len__(self):
        return len(self.tensors)

    def __getitem__(self, i):
        if torch.utils.data.get_worker_info() is not None:
            import time

            time.sleep(30)
        return self.tensors[i]


def stuck_loader_sets():
    train, test = digits_sets()
    return _SlowInLoader(train), test


def bad_sample_sets():
    """A training set whose every sample raises."""
    class Broken(torch.utils.data.Dataset):
        def __len__(self):
            return 384

        def __getitem__(self, i):
            raise IndexError(f"sample {i} is missing")

    return Broken(), digits_sets()[1]


def slow_metrics(model, batch):
    """The built-in evaluation, 0.5 s slower a batch."""
    time.sleep(0.5)
    return classification_metrics(model, batch)


def numpy_metrics(model, batch):
    """The built-in evaluation's figures as NumPy scalars (what a metric library gives)."""
    return {name: np.float32(value) for name, value in classification_metrics(model, batch).items()}


def text_metrics(model, batch):
    return {"accuracy": "high"}


def no_optimizer(params):
    return None


def plateau(optimizer):
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)


def loss_checking_the_lock(model: nn.Module, batch) -> torch.Tensor:
    """Cross-entropy, after checking that the run directory under $AKO_TEST_RUNS (once there
    is one: not in the checks before the run) is locked (by rank 0): raises RuntimeError,
    failing the run, when it is not."""
    from ako.run import lock

    runs = os.environ["AKO_TEST_RUNS"]
    for run_dir in (os.path.join(runs, d) for d in (os.listdir(runs) if os.path.isdir(runs) else ())):
        if os.path.abspath(run_dir) in lock._held:  # this process (rank 0) holds it
            continue
        try:
            lock.check_free(run_dir)
        except lock.RunDirBusy:
            continue
        raise RuntimeError(f"{run_dir} is not locked while the run trains")
    x, y = batch
    return F.cross_entropy(model(x), y)


def loss_that_raises(model: nn.Module, batch) -> torch.Tensor:
    """A loss that imports fine and raises when called."""
    raise ValueError("labels and logits disagree")
