"""One model replica: parameters and gradient held in flat buffers, and the local optimizer.

Strategies exchange and apply whole flat vectors (one tensor of shape (numel,), float32), never
per-parameter lists: communication is then one message or collective per step, and an update is
one fused optimizer call. The module's parameters and their `.grad` are views into those buffers
(the idea of DDP's `gradient_as_bucket_view`), so backward writes straight into the flat gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.sgd import sgd

from ako.data import fetch


@dataclass(frozen=True)
class OptimizerConfig:
    """SGD hyper-parameters: lr (> 0), momentum in [0, 1), Nesterov (only with momentum > 0),
    weight decay (L2, >= 0)."""

    lr: float
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0


class FlatSGD:
    """SGD (momentum, Nesterov, weight decay) on one flat parameter vector, updated in place.

    `params` (numel,) may be a view, e.g. a parameter server's shard of a replica's vector:
    the optimizer state (momentum buffer, numel floats) lives wherever this object does.
    SGD is elementwise, so shards stepped separately equal the whole vector stepped at once.
    The update is `torch.optim.SGD`'s own, through its functional form
    (`torch.optim.sgd.sgd`): making a `torch.optim.SGD` imports torch._dynamo, which adds
    2 s to the start of every worker process.
    """

    def __init__(self, params: torch.Tensor, optim: OptimizerConfig):
        self.params, self.optim = params, optim
        self.momentum_buffer: torch.Tensor | None = None  # made by the first step with momentum

    @torch.no_grad()
    def step(self, grad: torch.Tensor) -> None:
        """One optimizer step with `grad` (numel,) as the gradient."""
        o, buffers = self.optim, [self.momentum_buffer]
        sgd([self.params], [grad], buffers, weight_decay=o.weight_decay, momentum=o.momentum, lr=o.lr,
            dampening=0.0, nesterov=o.nesterov and o.momentum > 0, maximize=False)  # fmt: skip
        self.momentum_buffer = buffers[0]

    def state_dict(self) -> dict:
        """The optimizer state, for a checkpoint: the momentum buffer (numel,) or None."""
        buffer = self.momentum_buffer
        return {"momentum_buffer": None if buffer is None else buffer.detach().cpu().clone()}

    def load_state_dict(self, state: dict) -> None:
        buffer = state["momentum_buffer"]
        self.momentum_buffer = None if buffer is None else buffer.to(self.params.device, self.params.dtype)


class Replica:
    """A model replica with flat parameter and gradient buffers and an SGD optimizer.

    Attributes:
        model: the user's `nn.Module`; its parameters alias `params`.
        params: flat parameters, shape (numel,), float32. Writing to it changes the model.
        grad: flat gradient of the last `compute_gradient`, shape (numel,).
        boundaries: offsets where each parameter tensor starts, plus numel at the end: the
            places where a partition boundary keeps tensors whole.
    """

    def __init__(self, model: nn.Module, optim: OptimizerConfig):
        self.model = model
        tensors = [p for p in model.parameters() if p.requires_grad]
        if not tensors:
            raise ValueError("the model has no trainable parameters")
        sizes = [p.numel() for p in tensors]
        self.numel = sum(sizes)
        self.optim = optim
        self.params = torch.cat([p.detach().reshape(-1) for p in tensors]).float()
        self.grad = torch.zeros_like(self.params)
        offset = 0
        offsets = [0]
        for p, n in zip(tensors, sizes):
            p.data = self.params[offset : offset + n].view_as(p)
            p.grad = self.grad[offset : offset + n].view_as(p)
            offset += n
            offsets.append(offset)
        self.boundaries = offsets
        self.optimizer = FlatSGD(self.params, optim)

    @property
    def grad_bytes(self) -> int:
        """Size of one full gradient in bytes."""
        return self.numel * self.grad.element_size()

    def compute_gradient(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Forward and backward of the mean cross-entropy on one mini-batch.

        x: inputs (B, C, H, W); y: class labels (B,), int64. Leaves the gradient in `self.grad`
        (overwritten, not accumulated) and returns the mini-batch loss.
        """
        self.grad.zero_()
        self.model.train()
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss.item()

    def step(self, grad: torch.Tensor) -> None:
        """One optimizer step (momentum, weight decay) with `grad`, shape (numel,), as gradient."""
        self.optimizer.step(grad)

    def evaluate_params(self, params: torch.Tensor, dataset, batch_size: int = 256) -> tuple[float, float]:
        """`evaluate` with `params` (numel,) in place of this replica's own, which are kept."""
        own = self.params.clone()
        self.params.copy_(params)
        try:
            return self.evaluate(dataset, batch_size)
        finally:
            self.params.copy_(own)

    @torch.no_grad()
    def evaluate(self, dataset, batch_size: int = 256) -> tuple[float, float]:
        """Mean test loss and accuracy (fraction in [0, 1]) of this replica over `dataset`."""
        self.model.eval()
        loss_sum, correct, count = 0.0, 0, 0
        order = torch.arange(len(dataset))
        for idx in order.split(batch_size):
            x, y = fetch(dataset, idx)
            x, y = x.to(self.params.device), y.to(self.params.device)
            logits = self.model(x)
            loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
            correct += (logits.argmax(1) == y).sum().item()
            count += len(y)
        return loss_sum / count, correct / count
