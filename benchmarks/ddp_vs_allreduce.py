"""ako's `allreduce` against PyTorch DistributedDataParallel: same model, same 2 workers (one
thread each), same mini-batches, same optimizer; samples/s of each, side by side in one run.
With `--workers 1` the reference is a plain single-process loop (no DDP).

    .venv/bin/python benchmarks/ddp_vs_allreduce.py [--steps 400] [--repeats 5]
    .venv/bin/python benchmarks/ddp_vs_allreduce.py --model gpt [--workers 1]   # fortunes, AdamW, tokens/s

The cnn trains with SGD and momentum at batch 64 a worker; the gpt with AdamW at batch 16 a
worker on Debian's fortunes (sequences of 128 tokens).

Both runs do the same number of steps over the same shards of Fashion-MNIST (digits when it is
absent); each figure is the median over `repeats` runs, alternating the two, and the ratio is
the median of each pair's (this machine's speed drifts by tens of percent from run to run).
ako's all-reduces overlap backward (`ops.ComputeAllReduce`); DDP's defaults put this cnn's
0.83 MB gradient in one bucket, all-reduced after backward.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import ako
from ako.data import ShardSampler, fetch, load_dataset
from ako.models import build_model
from ako.replica import classification_loss
from ako.runtime.distributed.launcher import launch_function

SETTINGS = {  # model -> batch per worker, optimizer settings (TrainConfig's fields)
    "cnn": (64, dict(optimizer="sgd", lr=0.05, momentum=0.9, nesterov=False, weight_decay=0.0)),
    "gpt": (16, dict(optimizer="adamw", lr=3e-3)),
}


def optimizer_for(model_name: str, params) -> torch.optim.Optimizer:
    """The benchmark's optimizer for `model_name` (SETTINGS) over `params`."""
    settings = SETTINGS[model_name][1]
    if settings["optimizer"] == "sgd":
        return torch.optim.SGD(params, lr=settings["lr"], momentum=settings["momentum"])
    return torch.optim.AdamW(params, lr=settings["lr"])


def reference_worker(model_name: str, dataset: str, steps: int) -> float:
    """One DDP worker (a plain loop when alone); returns samples/s over `steps` steps (rank
    0's clock, after a barrier)."""
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=60)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, timeout)  # the launcher's
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    split = load_dataset(dataset)
    torch.manual_seed(0)
    model = build_model(model_name, split.input_shape, split.num_classes)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = optimizer_for(model_name, model.parameters())
    batch = SETTINGS[model_name][0]
    sampler = ShardSampler(len(split.train), rank, world, batch, seed=0)
    dist.barrier()
    start = time.perf_counter()
    for t in range(steps):
        optimizer.zero_grad(set_to_none=False)
        classification_loss(model, fetch(split.train, sampler.batch(t))).backward()  # cross-entropy (per token)
        optimizer.step()
    seconds = time.perf_counter() - start
    dist.destroy_process_group()
    return world * batch * steps / seconds


def ako_allreduce(model_name: str, dataset: str, workers: int, steps: int, out_dir: str) -> float:
    split = load_dataset(dataset)
    batch, settings = SETTINGS[model_name]
    per_epoch = ShardSampler(len(split.train), 0, workers, batch, 0).steps_per_epoch
    config = ako.TrainConfig(
        strategy="allreduce", workers=workers, dataset=dataset, model=model_name, batch_size=batch, **settings,
        epochs=steps / per_epoch, eval_every=1000.0, progress=False, out_dir=out_dir,
    )  # fmt: skip
    summary = ako.train(config).summary
    return summary["samples_per_second"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=tuple(SETTINGS), default="cnn")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out-dir", default="runs/benchmarks")
    args = parser.parse_args()
    if args.model == "gpt":
        dataset = "fortunes"
    else:
        dataset = "fashion-mnist" if ako.data.find_data_dir("fashion-mnist") else "digits"
    reference, ours = [], []
    for _ in range(args.repeats):
        reference.append(launch_function(reference_worker, args.workers, args.model, dataset, args.steps)[0])
        ours.append(ako_allreduce(args.model, dataset, args.workers, args.steps, args.out_dir))
    d, o = statistics.median(reference), statistics.median(ours)
    tokens = 128 if args.model == "gpt" else None
    unit = "tokens/s" if tokens else "samples/s"
    scale = tokens or 1
    name = "DistributedDataParallel" if args.workers > 1 else "plain PyTorch loop"
    print(f"{args.workers} worker(s) x 1 thread, {args.model} on {dataset}, batch {SETTINGS[args.model][0]} per worker, "
          f"{args.steps} steps, median of {args.repeats}")  # fmt: skip
    print(f"  {name:<24} {d * scale:8.0f} {unit}   runs: {', '.join(f'{v * scale:.0f}' for v in reference)}")
    print(f"  {'ako allreduce':<24} {o * scale:8.0f} {unit}   runs: {', '.join(f'{v * scale:.0f}' for v in ours)}")
    print(f"  ratio ako / reference    {statistics.median(a / b for a, b in zip(ours, reference)):8.3f}   (median of the pairs')")

if __name__ == "__main__":
    main()
