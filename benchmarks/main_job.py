"""The main job: `ako` and `allreduce` on 4 workers, the cnn on Fashion-MNIST, 2 epochs, side by
side in one run: time to 85% test accuracy, test accuracy after 2 epochs, samples/s and bytes
each worker sends per second.

    .venv/bin/python benchmarks/main_job.py [--workers 4] [--epochs 2] [--repeats 1]

Evaluations are of snapshots taken every quarter epoch and evaluated after training, so they
do not slow training; time is training seconds on rank 0's clock.
"""

from __future__ import annotations

import argparse
import statistics

import ako


def run(strategy: str, args) -> dict:
    config = ako.TrainConfig(
        strategy=strategy, workers=args.workers, dataset="fashion-mnist", model="cnn",
        epochs=args.epochs, eval_every=0.25, progress=False, out_dir=args.out_dir,
    )  # fmt: skip
    return ako.train(config).summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--strategies", default="ako,allreduce")
    parser.add_argument("--out-dir", default="runs/benchmarks")
    args = parser.parse_args()
    strategies = args.strategies.split(",")
    results = {s: [] for s in strategies}
    for _ in range(args.repeats):
        for s in strategies:
            results[s].append(run(s, args))
    print(f"{args.workers} workers, cnn on Fashion-MNIST, {args.epochs:g} epochs, median of {args.repeats}")
    print(f"{'strategy':<10} {'TTA 85% (s)':>12} {'acc end':>8} {'samples/s':>10} {'MB/s sent/worker':>17}  partitions")
    for s, runs in results.items():
        tta = [r["time_to_accuracy"]["0.85"] for r in runs]
        reached = [t for t in tta if t is not None]
        tta_text = f"{statistics.median(reached):.1f}" if len(reached) == len(tta) else "not reached"
        acc = statistics.median(r["test_accuracy"] for r in runs)
        rate = statistics.median(r["samples_per_second"] for r in runs)
        sent = statistics.median(r["bytes_sent_per_worker_per_second"] for r in runs) / 1e6
        parts = runs[0].get("partitions", "-")
        print(f"{s:<10} {tta_text:>12} {acc:>8.4f} {rate:>10.0f} {sent:>17.2f}  {parts}")


if __name__ == "__main__":
    main()
