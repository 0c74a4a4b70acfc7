"""One model replica: parameters and gradient held in flat buffers, and the local optimizer.

Strategies exchange and apply whole flat vectors (one tensor of shape (numel,), float32), never
per-parameter lists: communication is then one message or collective per step, and an update is
one fused optimizer call. The module's parameters and their `.grad` are views into those buffers
(the idea of DDP's `gradient_as_bucket_view`), so backward writes straight into the flat gradient.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ako.data import fetch, to_device
from ako.optim import Optimization

LossFn = Callable[[nn.Module, Any], torch.Tensor]  # (model, batch) -> scalar loss
EvalFn = Callable[[nn.Module, Any], dict]  # (model, batch) -> {metric: mean over the batch}


def classification_loss(model: nn.Module, batch) -> torch.Tensor:
    """The default loss: mean cross-entropy of `model(x)` (B, classes) against labels y (B,);
    of a language model's logits (B, T, vocabulary) against next tokens y (B, T), per token."""
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, -2), y.flatten())


def classification_metrics(model: nn.Module, batch) -> dict:
    """The default evaluation: mean cross-entropy ("loss", nats per sample, or per token for a
    language model's (B, T, vocabulary) logits) and accuracy (fraction in [0, 1]: of next
    tokens predicted, for a language model)."""
    x, y = batch
    logits = model(x).flatten(0, -2)
    y = y.flatten()
    return {"loss": F.cross_entropy(logits, y).item(), "accuracy": (logits.argmax(1) == y).float().mean().item()}


def language_model_metrics(model: nn.Module, batch) -> dict:
    """A language model's evaluation (the default on text): `classification_metrics` per token;
    `Replica.evaluate` adds the perplexity, exp(mean loss), through `finish`."""
    return classification_metrics(model, batch)


def _perplexity(metrics: dict) -> dict:
    """`metrics` with "perplexity" = exp("loss") (the loss in nats per token, averaged first:
    the mean of per-batch perplexities would not be one); capped where exp overflows."""
    return {**metrics, "perplexity": math.exp(min(metrics["loss"], 700.0))}


language_model_metrics.finish = _perplexity


class LossScale:
    """fp16's dynamic loss scale, with torch.amp.GradScaler's defaults: start at 2**16, halve
    and drop the gradient when it is not finite, double after 2000 finite steps in a row."""

    def __init__(self):
        self.scale, self.good, self.skipped = 2.0**16, 0, 0

    def unscale(self, grad: torch.Tensor) -> None:
        """Divide `grad` (numel,) by the scale; zero it (no contribution) if it overflowed."""
        grad.div_(self.scale)
        if torch.isfinite(grad).all():
            self.good += 1
            if self.good % 2000 == 0:
                self.scale *= 2.0
            return
        grad.zero_()
        self.scale, self.good, self.skipped = self.scale / 2.0, 0, self.skipped + 1


def buffers_misfit(buffers: dict[str, torch.Tensor], layout: dict) -> str | None:
    """Why saved `buffers` (tensors by name) cannot be a module's whose `Replica.buffer_layout`
    is `layout`, in words ("buffer bn.running_mean is torch.float32 (8,), the model's
    torch.float32 (16,)"), or None when they fit: the same names, each a dense tensor of the
    same dtype and shape (copy_ would broadcast a single value or convert a dtype without a
    word; a saved buffer the module lacks means another module, say GroupNorm for BatchNorm)."""
    if extra := sorted(buffers.keys() - layout.keys()):
        its = f"its are {', '.join(layout)}" if layout else "it has none"
        return f"buffer {extra[0]} is not the model's ({its})"
    for name, (dtype, shape) in layout.items():
        saved = buffers.get(name)
        if saved is None:
            return f"it has no buffer {name}"
        if saved.dtype != dtype or tuple(saved.shape) != shape:
            return f"buffer {name} is {saved.dtype} {tuple(saved.shape)}, the model's {dtype} {shape}"
        if saved.layout != torch.strided or saved.is_meta:
            return f"buffer {name} is not a dense tensor with values ({saved.layout}{', meta' if saved.is_meta else ''})"
    return None


class Replica:
    """A model replica with flat parameter and gradient buffers, the run's optimizer and the
    user's training step (`loss_fn`, `eval_fn`, `collate_fn`; defaults: classification).

    Attributes:
        model: the user's `nn.Module`; its parameters alias `params`.
        params: flat parameters, shape (numel,), float32. Writing to it changes the model.
        grad: flat gradient of the last `compute_gradient`, shape (numel,).
        slot: one float right after `grad` in `grad_and_slot` (numel + 1,): a value that rides
            in the all-reduce of the gradient's first bucket at no cost (the stop vote).
        boundaries: offsets where each parameter tensor starts, plus numel at the end: the
            places where a partition boundary keeps tensors whole.
    """

    def __init__(self, model: nn.Module, optimization: Optimization, loss_fn: LossFn | None = None,
                 eval_fn: EvalFn | None = None, collate_fn=None, precision: str = "fp32"):  # fmt: skip
        self.model = model
        self.optimization = optimization
        self.loss_fn, self.eval_fn = loss_fn or classification_loss, eval_fn or classification_metrics
        self.collate_fn, self.precision = collate_fn, precision
        self.loss_scale = LossScale() if precision == "fp16" else None
        tensors = [p for p in model.parameters() if p.requires_grad]
        if not tensors:
            raise ValueError("the model has no trainable parameters")
        sizes = [p.numel() for p in tensors]
        self.numel = sum(sizes)
        self.params = torch.cat([p.detach().reshape(-1) for p in tensors]).float()
        self.grad_and_slot = self.params.new_zeros(self.numel + 1)
        self.grad, self.slot = self.grad_and_slot[:-1], self.grad_and_slot[-1:]
        offset = 0
        offsets = [0]
        for p, n in zip(tensors, sizes):
            p.data = self.params[offset : offset + n].view_as(p)
            p.grad = self.grad[offset : offset + n].view_as(p)
            offset += n
            offsets.append(offset)
        self.boundaries = offsets
        self.optimizer = optimization.build(self.params)
        self.map_batches = map  # how `evaluate` runs its batches: one after another (the simulator gives threads)
        self._evaluated: dict[tuple, tuple[Any, dict]] = {}  # `evaluate_params`'s: key -> (data set, metrics)
        self._ready: Callable[[int], None] | None = None  # see `compute_gradient`
        for i, p in enumerate(tensors):
            p.register_post_accumulate_grad_hook(functools.partial(self._gradient_done, i))

    def _gradient_done(self, i: int, _param) -> None:
        if self._ready is not None:
            self._ready(i)

    @property
    def grad_bytes(self) -> int:
        """Size of one full gradient in bytes."""
        return self.numel * self.grad.element_size()

    def new_optimizer(self, params: torch.Tensor):
        """The run's optimizer and schedule for `params` (a shard of this replica's vector, on
        a server)."""
        return self.optimization.build(params)

    def _autocast(self):
        if self.precision == "fp32":
            return nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        return torch.autocast(self.params.device.type, dtype=dtype)

    def buckets(self, bucket_bytes: int) -> list[tuple[int, int]]:
        """The flat gradient cut into buckets for all-reduces that overlap backward, in the
        order backward finishes them (last parameter tensor first, as DDP orders its buckets):
        [lo, hi) ranges of whole tensors of `grad_and_slot`, each closed once it holds
        `bucket_bytes` or more (0: a bucket per tensor); the first one also holds `slot`."""
        buckets, hi = [], self.numel + 1
        for lo in reversed(self.boundaries[:-1]):
            if (hi - lo) * self.grad.element_size() >= bucket_bytes:
                buckets.append((lo, hi))
                hi = lo
        return buckets + [(0, hi)] if hi else buckets

    def compute_gradient(self, batches: list, ready: Callable[[int], None] | None = None) -> float:
        """Forward and backward of `loss_fn` on the micro-batches of one step (each what the
        collate function makes, on this replica's device), accumulated: the gradient of their
        mean loss is left in `self.grad` (overwritten, not added to). Returns that mean loss.
        `ready(i)`, when given, is called during the last micro-batch's backward as soon as
        parameter tensor i's gradient (`self.grad[boundaries[i]:boundaries[i + 1]]`) is final
        (not with fp16, whose loss scale is taken out after backward)."""
        self.grad.zero_()
        self.model.train()
        total = 0.0
        for k, batch in enumerate(batches):
            with self._autocast():
                loss = self.loss_fn(self.model, batch) / len(batches)
            self._ready = ready if k == len(batches) - 1 and self.loss_scale is None else None
            try:
                (loss if self.loss_scale is None else loss * self.loss_scale.scale).backward()
            finally:
                self._ready = None
            total += loss.item()
        if self.loss_scale is not None:
            self.loss_scale.unscale(self.grad)
        return total

    def _buffer_state(self) -> dict[str, torch.Tensor]:
        params = {name for name, _ in self.model.named_parameters()}
        return {k: v for k, v in self.model.state_dict().items() if k not in params and isinstance(v, torch.Tensor)}

    def buffers(self) -> dict[str, torch.Tensor]:
        """Copies of the module's state that is not a parameter, by `state_dict` name: its
        persistent buffers (BatchNorm's running statistics and count), on the CPU."""
        return {name: t.detach().cpu().clone() for name, t in self._buffer_state().items()}

    def buffer_layout(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """The dtype and shape of each of the module's buffers (`buffers`), by name."""
        return {name: (t.dtype, tuple(t.shape)) for name, t in self._buffer_state().items()}

    def load_buffers(self, buffers: dict[str, torch.Tensor]) -> None:
        """Set the module's buffers to `buffers` (what `buffers` gave). Raises ValueError for
        a buffer `buffers` lacks or holds with another shape or dtype (`buffers_misfit`)."""
        if (why := buffers_misfit(buffers, self.buffer_layout())) is not None:
            raise ValueError(why)
        for name, live in self._buffer_state().items():  # state_dict's tensors share the buffers' storage
            live.copy_(buffers[name])

    def step(self, grad: torch.Tensor) -> None:
        """One optimizer step (and schedule step) with `grad`, shape (numel,), as gradient."""
        self.optimizer.step(grad)

    def evaluate_params(self, params: torch.Tensor, dataset, batch_size: int = 256) -> dict:
        """`evaluate` with `params` (numel,) in place of this replica's own, which are kept.
        Parameters evaluated before on `dataset` (the same bytes, and the same buffers, in the
        state dict or not) are not
        evaluated again: their metrics are remembered by a digest (BLAKE2b, 128 bits) of those
        bytes. Identical replicas make this common: their average is rank 0's replica at the
        start, and after Ako's flush. (A user's `eval_fn` that draws random numbers gets its
        first draw's metrics again.)"""
        key = (self._digest(params), batch_size)
        known = self._evaluated.get(key)
        if known is not None and known[0] is dataset:
            return dict(known[1])
        own = self.params.clone()
        self.params.copy_(params)
        try:
            metrics = self.evaluate(dataset, batch_size)
        finally:
            self.params.copy_(own)
        self._evaluated[key] = (dataset, dict(metrics))
        return metrics

    def _digest(self, params: torch.Tensor) -> bytes:
        """A digest of `params`' bytes and the module's buffers' (persistent or not: what an
        evaluation depends on)."""
        h = hashlib.blake2b(digest_size=16)
        for t in (params, *self.model.buffers()):
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        return h.digest()

    def evaluate(self, dataset, batch_size: int = 256) -> dict:
        """`eval_fn`'s metrics of this replica over `dataset`: each the mean over samples of
        the per-batch means (weighted by batch size). Default: {"loss", "accuracy"}. The
        batches go through `map_batches` (the builtin `map`, or the simulator's threads); the
        sums are taken in batch order either way."""
        self.model.eval()
        batches = torch.arange(len(dataset)).split(batch_size)
        sums: dict[str, float] = {}
        for idx, metrics in zip(batches, self.map_batches(functools.partial(self._batch_metrics, dataset), batches)):
            for name, value in metrics.items():
                sums[name] = sums.get(name, 0.0) + float(value) * len(idx)
        means = {name: total / len(dataset) for name, total in sums.items()}
        finish = getattr(self.eval_fn, "finish", None)  # metrics of the whole set, from the means
        return means if finish is None else finish(means)

    @torch.no_grad()  # on the thread that runs it: grad mode is per thread
    def _batch_metrics(self, dataset, idx: torch.Tensor) -> dict:
        batch = to_device(fetch(dataset, idx, self.collate_fn), self.params.device)
        with self._autocast():
            return self.eval_fn(self.model, batch)
