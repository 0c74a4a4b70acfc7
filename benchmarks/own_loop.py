"""Your own loop under ako (`ako.wrap`) against DDP and against `ako train`, side by side.

    .venv/bin/python benchmarks/own_loop.py [--steps 300] [--repeats 3] [--models cnn,gpt]

1. DDP against the same loop wrapped for `allreduce`: 2 workers (one thread each), the cnn on
   Fashion-MNIST (digits when absent) with SGD and momentum at batch 64 a worker, and the gpt
   on the fortunes with AdamW at batch 16 a worker; the same shards, steps and optimizer.
   Samples/s of each (tokens/s for the gpt), the median over `repeats` runs, alternating; the
   ratio is the median of each pair's. Goal (issue 42): >= 0.95.
2. The cnn loop wrapped for `ako` against `ako train --strategy ako` with the same settings
   (2 workers, the same batch, optimizer, steps and seed): samples/s and the final test
   accuracy of each. Goal: samples/s >= 0.95x, the same accuracy.

The loops time from after the wrap (or DDP's construction) to after `finish` (Ako's flush
included); `ako train`'s figure is its summary's samples/s (training time, evaluations paused).
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
from ako.replica import classification_loss, classification_metrics
from ako.runtime.distributed.launcher import launch_function
from ddp_vs_allreduce import SETTINGS, optimizer_for  # the same settings as the DDP benchmark

def _dataset(model_name: str) -> str:
    if model_name == "gpt":
        return "fortunes"
    return "fashion-mnist" if ako.data.find_data_dir("fashion-mnist") else "digits"


def loop_worker(model_name: str, how: str, steps: int) -> dict:
    """One worker's loop: `how` is "ddp", or a strategy for `ako.wrap`. Returns samples/s (rank
    0's clock) and, for rank 0, the test accuracy of the model at the end."""
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    split = load_dataset(_dataset(model_name))
    torch.manual_seed(0)
    model = build_model(model_name, split.input_shape, split.num_classes)
    optimizer = optimizer_for(model_name, model.parameters())
    batch = SETTINGS[model_name][0]
    sampler = ShardSampler(len(split.train), rank, world, batch, seed=0)
    if how == "ddp":
        timeout = timedelta(seconds=60)
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        model = torch.nn.parallel.DistributedDataParallel(model)
        dist.barrier()
    else:
        model, optimizer = ako.wrap(model, optimizer, strategy=how, timeout=60)
    start = time.perf_counter()
    for t in range(steps):
        optimizer.zero_grad(set_to_none=False)
        classification_loss(model, fetch(split.train, sampler.batch(t))).backward()
        optimizer.step()
    if how == "ddp":
        dist.barrier()
        model = model.module
    else:
        model = ako.finish(model)
    seconds = time.perf_counter() - start
    if how == "ddp":
        dist.destroy_process_group()
    result = {"samples_per_second": world * batch * steps / seconds}
    if rank == 0 and model_name == "cnn":
        test = torch.utils.data.Subset(split.test, range(min(2000, len(split.test))))
        x, y = fetch(test.dataset, torch.arange(len(test)))
        with torch.no_grad():
            model.eval()
            result["test_accuracy"] = classification_metrics(model, (x, y))["accuracy"]
    return result


def ako_train(model_name: str, steps: int, out_dir: str) -> dict:
    split = load_dataset(_dataset(model_name))
    batch, settings = SETTINGS[model_name]
    per_epoch = ShardSampler(len(split.train), 0, 2, batch, 0).steps_per_epoch
    config = ako.TrainConfig(strategy="ako", workers=2, dataset=_dataset(model_name), model=model_name, batch_size=batch,
                             **settings, epochs=steps / per_epoch, eval_every=1000.0, test_samples=2000, progress=False,
                             out_dir=out_dir)  # fmt: skip
    summary = ako.train(config).summary
    return {"samples_per_second": summary["samples_per_second"], "test_accuracy": summary["test_accuracy"]}


def _line(name: str, values: list[float], unit: str) -> str:
    return f"  {name:<28} {statistics.median(values):9.0f} {unit}   runs: {', '.join(f'{v:.0f}' for v in values)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="cnn,gpt")
    parser.add_argument("--out-dir", default="runs/benchmarks")
    args = parser.parse_args()
    for model_name in args.models.split(","):
        scale, unit = (128, "tokens/s") if model_name == "gpt" else (1, "samples/s")
        ddp, ours = [], []
        for _ in range(args.repeats):
            ddp.append(launch_function(loop_worker, 2, model_name, "ddp", args.steps)[0]["samples_per_second"] * scale)
            ours.append(launch_function(loop_worker, 2, model_name, "allreduce", args.steps)[0]["samples_per_second"] * scale)
        print(f"2 workers x 1 thread, {model_name} on {_dataset(model_name)}, {args.steps} steps, median of {args.repeats}")
        print(_line("DistributedDataParallel", ddp, unit))
        print(_line("your loop, ako.wrap allreduce", ours, unit))
        print(f"  ratio wrapped / DDP          {statistics.median(a / b for a, b in zip(ours, ddp)):9.3f}   (goal >= 0.95)")
    loop, trained = [], []
    for _ in range(args.repeats):
        loop.append(launch_function(loop_worker, 2, "cnn", "ako", args.steps)[0])
        trained.append(ako_train("cnn", args.steps, args.out_dir))
    print(f"2 workers x 1 thread, cnn on {_dataset('cnn')}, strategy ako (defaults), {args.steps} steps, median of {args.repeats}")
    print(_line("ako train --strategy ako", [r["samples_per_second"] for r in trained], "samples/s"))
    print(_line("your loop, ako.wrap ako", [r["samples_per_second"] for r in loop], "samples/s"))
    ratio = statistics.median(a["samples_per_second"] / b["samples_per_second"] for a, b in zip(loop, trained))
    print(f"  ratio wrapped / ako train    {ratio:9.3f}   (goal >= 0.95)")
    accuracy = [(r["test_accuracy"], s["test_accuracy"]) for r, s in zip(loop, trained)]
    print(f"  test accuracy (loop, ako train) on 2000 test samples: {', '.join(f'{a:.4f}/{b:.4f}' for a, b in accuracy)}")


if __name__ == "__main__":
    main()
