"""Train `net.Net` with Adadelta and a StepLR schedule (pytorch/examples' mnist settings) on
Fashion-MNIST, data-parallel on 2 workers with ako's all-reduce, through the Python API:

    .venv/bin/python examples/own_network/train_api.py [EPOCHS]     # default 2

The optimizer and schedule are built by the user's own functions here; the command in
examples/own_network/README.md does the same with flags.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import ako

sys.path.insert(0, str(Path(__file__).parent))  # net.py beside this file, also in the spawned workers
from net import Net, evaluate, nll  # noqa: E402


def adadelta(params):
    return torch.optim.Adadelta(params, lr=1.0)


def step_lr(optimizer):
    """StepLR(gamma=0.7) once per epoch, as pytorch/examples does; ako steps schedules once per
    optimizer step, so the step size is an epoch's steps: 60000 samples / 2 workers / 64."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=60000 // 2 // 64, gamma=0.7)


if __name__ == "__main__":
    epochs = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    config = ako.TrainConfig(strategy="allreduce", workers=2, dataset="fashion-mnist", batch_size=64, epochs=epochs,
                             eval_every=0.5, out_dir="runs")  # fmt: skip
    result = ako.train(config, model_fn=Net, loss_fn=nll, eval_fn=evaluate, optimizer_fn=adadelta, scheduler_fn=step_lr)
    model = ako.load_model(result.summary["run_dir"], Net)  # model.pt, a plain state_dict
    print(f"model.pt: test accuracy {result.summary['saved_model']['test_accuracy']:.4f}; "
          f"{sum(p.numel() for p in model.parameters())} parameters")
