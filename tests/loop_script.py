"""A user's own training loop with ako's three lines, for tests/test_loop.py: run as a script
(`ako run --workers 2 tests/loop_script.py OUT [STEPS] [SLEEP] [raise|exit]` or under torchrun)
it trains `mlp` on `digits_like` for STEPS steps of its shard (rank 1 raising or calling sys.exit
at its third step, where asked) and saves each rank's final flat parameters
as OUT/rank<r>.pt; imported, it gives `ako train` the same model and data."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import ako

BATCH = 16
LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 1e-3


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def digits_like(n: int = 384) -> torch.utils.data.TensorDataset:
    """n samples of 8x8 "images" (1, 8, 8) and labels from a fixed rule (seeded)."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(n, 1, 8, 8, generator=generator)
    y = (x.flatten(1)[:, :10].argmax(1) + (x.mean((1, 2, 3)) > 0).long() * 3) % 10
    return torch.utils.data.TensorDataset(x, y)


def main(out: str, steps: int, sleep: float, fail: str = "") -> None:
    torch.manual_seed(0)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, nesterov=True, weight_decay=WEIGHT_DECAY)
    loader = torch.utils.data.DataLoader(digits_like(), batch_size=BATCH)
    model, optimizer, loader = ako.wrap(model, optimizer, loader)
    done = 0
    while done < steps:
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            time.sleep(sleep)
            done += 1
            if fail and done == 3 and os.environ["RANK"] == "1":  # the user's code fails on rank 1
                raise RuntimeError("boom") if fail == "raise" else SystemExit(3)
            if done == steps:
                break
    model = ako.finish(model)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.save(flat, os.path.join(out, f"rank{os.environ['RANK']}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 6, float(sys.argv[3]) if len(sys.argv) > 3 else 0.0,
         sys.argv[4] if len(sys.argv) > 4 else "")
