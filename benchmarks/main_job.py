"""The main job: strategies side by side on 4 workers, the cnn on Fashion-MNIST, 2 epochs, in
one run: time to 85% test accuracy (rank 0's replica, and the replicas' average for the
decentralised strategies), test accuracy after 2 epochs, the final consensus distance,
samples/s and bytes each worker sends per second.

    .venv/bin/python benchmarks/main_job.py [--workers 4] [--epochs 2] [--repeats 1]
        [--strategies ako,allreduce,gossip:pull,gossip:push-sum]

A strategy is a name, or `gossip:MODE` for gossip with --gossip MODE (pull or push-sum).
Evaluations are of snapshots taken every quarter epoch and evaluated after training, so they
do not slow training; time is training seconds on rank 0's clock.
"""

from __future__ import annotations

import argparse
import statistics

import ako

STRATEGIES = "ako,allreduce,gossip:pull,gossip:push-sum"


def run(spec: str, args) -> dict:
    strategy, _, mode = spec.partition(":")
    options = {"gossip": mode} if mode else {}
    config = ako.TrainConfig(
        strategy=strategy, workers=args.workers, dataset="fashion-mnist", model="cnn",
        epochs=args.epochs, eval_every=0.25, progress=False, out_dir=args.out_dir, **options,
    )  # fmt: skip
    return ako.train(config).summary


def median_time(times: list[float | None]) -> str:
    """The median time in seconds, or "not reached" when a run did not reach the level."""
    reached = [t for t in times if t is not None]
    return f"{statistics.median(reached):.1f}" if reached and len(reached) == len(times) else "not reached"


def row(spec: str, runs: list[dict]) -> str:
    def med(key):
        values = [r[key] for r in runs if r.get(key) is not None]
        return statistics.median(values) if values else None

    tta = median_time([r["time_to_accuracy"]["0.85"] for r in runs])
    decentralised = runs[0].get("average_time_to_accuracy") is not None
    tta_avg = median_time([r["average_time_to_accuracy"]["0.85"] for r in runs]) if decentralised else "-"
    avg_acc = f"{med('average_accuracy'):.4f}" if decentralised else "-"
    consensus = f"{med('consensus_distance'):.2g}" if decentralised else "-"
    sent = med("bytes_sent_per_worker_per_second") / 1e6
    return (
        f"{spec:<16} {tta:>12} {tta_avg:>12} {med('test_accuracy'):>8.4f} {avg_acc:>8} {consensus:>9} "
        f"{med('samples_per_second'):>10.0f} {sent:>11.2f}  {runs[0].get('partitions', '-')}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--strategies", default=STRATEGIES)
    parser.add_argument("--out-dir", default="runs/benchmarks")
    args = parser.parse_args()
    specs = args.strategies.split(",")
    results = {s: [] for s in specs}
    for _ in range(args.repeats):
        for s in specs:
            results[s].append(run(s, args))
    print(f"{args.workers} workers, cnn on Fashion-MNIST, {args.epochs:g} epochs, median of {args.repeats}")
    print(
        f"{'strategy':<16} {'TTA 85% (s)':>12} {'avg TTA 85%':>12} {'acc end':>8} {'avg acc':>8} "
        f"{'consensus':>9} {'samples/s':>10} {'MB/s sent':>11}  partitions"
    )
    for s, runs in results.items():
        print(row(s, runs))


if __name__ == "__main__":
    main()
