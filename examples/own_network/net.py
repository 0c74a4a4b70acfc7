"""A user's own network, optimizer settings, loss and metrics, in the style of pytorch/examples'
mnist/main.py: two conv layers, dropout, log-softmax outputs and the negative log-likelihood
loss. Nothing here knows about ako; `train_api.py` and the command in README.md train it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    """28x28 grey images (B, 1, 28, 28) -> log-probabilities of 10 classes (B, 10)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def nll(model: nn.Module, batch) -> torch.Tensor:
    """The training loss: negative log-likelihood of the log-softmax outputs."""
    x, y = batch
    return F.nll_loss(model(x), y)


def evaluate(model: nn.Module, batch) -> dict:
    """The test metrics of one batch: its mean loss and accuracy."""
    x, y = batch
    out = model(x)
    return {"loss": F.nll_loss(out, y).item(), "accuracy": (out.argmax(1) == y).float().mean().item()}
