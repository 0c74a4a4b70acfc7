"""ako's `allreduce` against PyTorch DistributedDataParallel: same model, same 2 workers (one
thread each), same mini-batches, same optimizer; samples/s of each, side by side in one run.

    .venv/bin/python benchmarks/ddp_vs_allreduce.py [--steps 400] [--repeats 5]

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
import torch.nn.functional as F

import ako
from ako.data import ShardSampler, fetch, load_dataset
from ako.models import build_model
from ako.runtime.distributed.launcher import launch_function

WORKERS, BATCH = 2, 64


def ddp_worker(dataset: str, steps: int) -> float:
    """One DDP worker; returns samples/s over `steps` steps (rank 0's clock, after a barrier)."""
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=60)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, timeout)  # the launcher's
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    split = load_dataset(dataset)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(build_model("cnn", split.input_shape, split.num_classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler = ShardSampler(len(split.train), rank, world, BATCH, seed=0)
    dist.barrier()
    start = time.perf_counter()
    for t in range(steps):
        x, y = fetch(split.train, sampler.batch(t))  # the built-in data sets give (x, y)
        optimizer.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    seconds = time.perf_counter() - start
    dist.destroy_process_group()
    return world * BATCH * steps / seconds


def ako_allreduce(dataset: str, steps: int, out_dir: str) -> float:
    split = load_dataset(dataset)
    per_epoch = ShardSampler(len(split.train), 0, WORKERS, BATCH, 0).steps_per_epoch
    config = ako.TrainConfig(
        strategy="allreduce", workers=WORKERS, dataset=dataset, batch_size=BATCH, lr=0.05, momentum=0.9,
        epochs=steps / per_epoch, eval_every=1000.0, progress=False, out_dir=out_dir,
    )  # fmt: skip
    summary = ako.train(config).summary
    return summary["samples_per_second"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out-dir", default="runs/benchmarks")
    args = parser.parse_args()
    dataset = "fashion-mnist" if ako.data.find_data_dir("fashion-mnist") else "digits"
    ddp, ours = [], []
    for _ in range(args.repeats):
        ddp.append(launch_function(ddp_worker, WORKERS, dataset, args.steps)[0])
        ours.append(ako_allreduce(dataset, args.steps, args.out_dir))
    d, o = statistics.median(ddp), statistics.median(ours)
    print(f"{WORKERS} workers x 1 thread, cnn on {dataset}, batch {BATCH} per worker, {args.steps} steps, "
          f"median of {args.repeats}")  # fmt: skip
    print(f"  DistributedDataParallel  {d:8.0f} samples/s   runs: {', '.join(f'{v:.0f}' for v in ddp)}")
    print(f"  ako allreduce            {o:8.0f} samples/s   runs: {', '.join(f'{v:.0f}' for v in ours)}")
    print(f"  ratio ako / DDP          {statistics.median(a / b for a, b in zip(ours, ddp)):8.3f}   (median of the pairs')")


if __name__ == "__main__":
    main()
