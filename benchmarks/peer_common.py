"""What every peer arm of `benchmarks/peers.py` shares with ako's own runs: the cnn on
Fashion-MNIST (or, with `--model gpt`, the gpt on Debian's fortunes), initialised from the seed
as `ako train` initialises it; the same shards and mini-batches (`ako.data.ShardSampler`); ako's
default optimizer for the cnn (SGD, lr 0.1 of the averaged gradient, Nesterov momentum 0.9,
weight decay 5e-4) and the language model's recipe for the gpt (AdamW at `--lr`, torch's
defaults otherwise, 20 warm-up steps and a cosine over the run, as `ako.optim.schedule` makes
them; the arm steps the schedule after each optimizer step); the same straggler (a worker that sleeps
(factor - 1) times its forward+backward time each step, as `ako train --straggler` does; a
peer's backward holds its communication, so the forward+backward time is this step's forward
time x the ratio of forward+backward to forward measured before training, and the sleep falls
between forward and backward, so that the peer's communication waits for it as for a slow
machine's);
and the same evaluation (every worker snapshots its replica every `--eval-every` epochs;
rank 0's snapshots are evaluated on the test set (the gpt: the first 256 validation sequences,
loss per character) after training, so that evaluating does not
slow training, and `average_records` evaluates the replicas' average from every rank's).

A peer arm is a script that each worker process runs (under torchrun, or as the peer's own
documentation launches it), with `add_arguments`'s flags; rank 0 writes the arm's result as JSON
to `--out`: {"arm", "workers", "records": [{"seconds", "epoch", "samples", "accuracy", "loss"}],
"train_seconds", "samples_per_second", "bytes_sent_per_worker_per_second" (payload bytes the arm
counted itself; null when it cannot count them), "steps"}.

This module needs only torch and ako: it runs in ako's virtualenv and in the peers' one
(`benchmarks/peers_venv.sh`).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from ako.data import ShardSampler, fetch, load_dataset
from ako.metrics import write_atomic
from ako.models import build_model
from ako.optim import schedule

DATASETS = {"cnn": "fashion-mnist", "gpt": "fortunes"}  # --model -> its data set
LM_TEST_SAMPLES = 256  # validation sequences, as ako train evaluates a language model
LM_WARMUP = "20"  # the language model's warm-up steps (docs/training.md's recipe)


def load_split(model_name: str, train_samples=None, test_samples=None):
    """The data set of `model_name` (DATASETS): ako's DataSplit."""
    if model_name == "gpt" and test_samples is None:
        test_samples = LM_TEST_SAMPLES
    return load_dataset(DATASETS[model_name], train_samples=train_samples, test_samples=test_samples)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every arm takes (peers.py passes the same values to every arm and to ako)."""
    parser.add_argument("--model", choices=sorted(DATASETS), default="cnn")
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--batch-size", type=int, default=64, help="per worker")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=float, default=0.1, help="epochs between snapshots")
    parser.add_argument("--straggler", default="", help="rank=R,factor=K: worker R is K times slower")
    parser.add_argument("--train-samples", type=int, default=None, help="only the first k training examples")
    parser.add_argument("--test-samples", type=int, default=None)
    parser.add_argument("--out", required=True, help="rank 0 writes the result here (JSON)")


def parse_straggler(text: str) -> tuple[int, float]:
    """`rank=R,factor=K` -> (R, K); "" -> (-1, 1.0)."""
    if not text:
        return -1, 1.0
    fields = dict(part.split("=", 1) for part in text.split(","))
    return int(fields["rank"]), float(fields["factor"])


class Trainer:
    """One worker's data, model, optimizer, straggler delay and snapshots.

    `rank` and `world` are this worker's place among the data-parallel workers (for torchft and
    Hivemind, where every worker is its own replica group, not torch.distributed's rank)."""

    def __init__(self, args, rank: int, world: int):
        torch.set_num_threads(1)
        self.args, self.rank, self.world = args, rank, world
        self.split = load_split(args.model, args.train_samples, args.test_samples)
        torch.manual_seed(args.seed)  # as ako.run.job.Job.build_model
        self.model = build_model(args.model, self.split.input_shape, self.split.num_classes)
        self.sampler = ShardSampler(len(self.split.train), rank, world, args.batch_size, args.seed)
        self.steps = max(1, round(args.epochs * self.sampler.steps_per_epoch))
        self.snapshot_every = max(1, round(args.eval_every * self.sampler.steps_per_epoch))
        self.slow_rank, self.factor = parse_straggler(args.straggler)
        self.backward_ratio = self.forward_backward_ratio() if rank == self.slow_rank else 1.0
        self.forward_seconds = 0.0  # the last `loss`'s
        self.snapshots: list[tuple[float, int, torch.Tensor]] = []  # (training seconds, step, params)
        self.start = time.perf_counter()

    def optimizer(self, params=None) -> torch.optim.Optimizer:
        """The model's optimizer (ako's default for the cnn, AdamW for the gpt) for `params`
        (default: the model's)."""
        params = self.model.parameters() if params is None else params
        if self.args.model == "gpt":
            return torch.optim.AdamW(params, lr=self.args.lr)
        return torch.optim.SGD(params, lr=self.args.lr, momentum=0.9, nesterov=True, weight_decay=5e-4)

    def scheduler(self, optimizer: torch.optim.Optimizer):
        """The gpt's warm-up and cosine over this run's steps, for `optimizer`; None for the cnn
        (a constant rate)."""
        if self.args.model != "gpt":
            return None
        return schedule(optimizer, SimpleNamespace(epochs=self.args.epochs, warmup=LM_WARMUP, lr_schedule="cosine"),
                        self.steps)  # fmt: skip

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step `step`'s mini-batch of this worker: images (B, 1, 28, 28) and labels (B,), or
        token ids (B, T) and next tokens (B, T)."""
        return fetch(self.split.train, self.sampler.batch(step))

    def loss(self, model, step: int) -> torch.Tensor:
        """Forward: the mean cross-entropy (per token for the gpt) of step `step`'s mini-batch
        (its time in `forward_seconds`)."""
        x, y = self.batch(step)
        start = time.perf_counter()
        loss = cross_entropy(model(x), y)
        self.forward_seconds = time.perf_counter() - start
        return loss

    def begin(self) -> None:
        """Training starts now (after every worker has joined)."""
        self.start = time.perf_counter()

    def forward_backward_ratio(self, repeats: int = 5) -> float:
        """Median over `repeats` steps (after one warm-up) of forward+backward time over forward
        time, on a copy of the model."""
        model = copy.deepcopy(self.model)
        ratios = []
        for step in range(repeats + 1):
            x, y = self.batch(step)
            start = time.perf_counter()
            loss = cross_entropy(model(x), y)
            forward = time.perf_counter() - start
            loss.backward()
            ratios.append((time.perf_counter() - start) / forward)
        return statistics.median(ratios[1:])

    def straggle(self) -> None:
        """The straggler's delay (nothing on other workers): (factor - 1) x this step's
        forward+backward time. Call it between forward (`loss`) and backward."""
        if self.rank == self.slow_rank and self.factor > 1:
            time.sleep((self.factor - 1) * self.forward_seconds * self.backward_ratio)

    def after_step(self, step: int, model=None) -> None:
        """Snapshot `model` (default: the trainer's) after steps that end an evaluation period
        and after the last step (`step` counts from 1); after the last, every rank but 0
        writes its snapshots to `--out`.rank<r>.pt (for the replicas' average, `average_records`)."""
        if step % self.snapshot_every == 0 or step == self.steps:
            params = torch.cat([p.detach().reshape(-1) for p in (model or self.model).parameters()])
            self.snapshots.append((time.perf_counter() - self.start, step, params.clone()))
        if step == self.steps and self.rank != 0:
            tmp = Path(f"{self.args.out}.rank{self.rank}.tmp")
            torch.save([(at, params) for at, _, params in self.snapshots], tmp)
            tmp.replace(f"{self.args.out}.rank{self.rank}.pt")

    def finish(self, arm: str, bytes_sent: int | None, model=None, facts: dict | None = None) -> dict | None:
        """Rank 0: evaluate the snapshots and write the result to `--out`; returns it (None
        elsewhere). `bytes_sent`: this worker's payload bytes sent, or None."""
        if self.rank != 0:
            return None
        seconds = time.perf_counter() - self.start
        model = model or self.model
        records = []
        for at, step, params in self.snapshots:
            torch.nn.utils.vector_to_parameters(params, model.parameters())
            records.append({"seconds": round(at, 4), "epoch": step / self.sampler.steps_per_epoch,
                            "samples": step * self.world * self.args.batch_size, **evaluate(model, self.split.test)})  # fmt: skip
        torch.save([(at, params) for at, _, params in self.snapshots], Path(f"{self.args.out}.rank0.pt"))
        result = {
            "arm": arm, "model": self.args.model, "workers": self.world, "steps": self.steps, "records": records,
            "train_seconds": round(seconds, 3),
            "samples_per_second": self.steps * self.world * self.args.batch_size / seconds,
            "bytes_sent_per_worker_per_second": None if bytes_sent is None else bytes_sent / seconds,
            **(facts or {}),
        }  # fmt: skip
        write_atomic(Path(self.args.out), json.dumps(result, indent=1))
        return result


def cross_entropy(logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of logits (B, classes) against labels (B,), or of a language model's
    (B, T, vocabulary) against next tokens (B, T), per token."""
    return F.cross_entropy(logits.flatten(0, -2), y.flatten(), reduction=reduction)


@torch.no_grad()
def evaluate(model, test_set, batch_size: int = 256) -> dict:
    """Mean test loss (per sample, or per token) and accuracy of `model` over `test_set`."""
    model.eval()
    loss = correct = count = 0.0
    for idx in torch.arange(len(test_set)).split(batch_size):
        x, y = fetch(test_set, idx)
        logits = model(x)
        loss += cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(-1) == y).sum().item()
        count += y.numel()
    model.train()
    return {"loss": loss / count, "accuracy": correct / count}


def average_records(out: Path, records: list[dict], workers: int) -> list[dict] | None:
    """The replicas' average after each of the snapshot steps of rank 0's `records`, evaluated on
    the test set, from every rank's `out`.rank<r>.pt; its `seconds` are the latest of the
    ranks' times at that step (when every replica had got there: ranks that do not keep in step
    would otherwise lend the average their future). None when a rank's file is missing (a rank
    that died, or an arm that keeps no such files)."""
    files = [Path(f"{out}.rank{r}.pt") for r in range(workers)]
    if not all(f.exists() for f in files):
        return None
    ranks = [torch.load(f) for f in files]
    model_name = json.loads(out.read_text()).get("model", "cnn")
    split = load_split(model_name)
    torch.manual_seed(0)
    model = build_model(model_name, split.input_shape, split.num_classes)
    averaged = []
    for k, record in enumerate(records):
        torch.nn.utils.vector_to_parameters(torch.stack([r[k][1] for r in ranks]).mean(0), model.parameters())
        seconds = max(r[k][0] for r in ranks)
        averaged.append({**record, "seconds": round(seconds, 4), **evaluate(model, split.test)})
    return averaged


def env_rank() -> tuple[int, int]:
    """(rank, world size) as torchrun sets them."""
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

