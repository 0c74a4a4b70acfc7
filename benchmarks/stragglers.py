"""Every strategy under one straggler, side by side in one run: 4 workers (and 1 server for the
parameter-server strategies), the cnn on Fashion-MNIST, worker 1 slowed by a factor of 3. Prints
time to 85% test accuracy, iterations and samples/s per strategy, and the ratio to bsp.

    .venv/bin/python benchmarks/stragglers.py [--factor 3] [--repeats 1] [--strategies bsp,absp]

Each run trains --epochs; rank 0 snapshots its replica every 0.1 epoch and the snapshots are
evaluated after training. (Stopping at the target would need evaluations during training, which
pause rank 0 while the other workers of the asynchronous strategies train on: that flatters them.)
"""

from __future__ import annotations

import argparse
import statistics

import ako

VARIANTS = {
    "bsp": {},
    "ssp": {"staleness": 2},
    "asp": {},
    "absp": {},
    "easgd": {},
    "allreduce": {},
    "ako": {},
}


def run(strategy: str, args) -> dict:
    config = ako.TrainConfig(
        strategy=strategy, workers=args.workers, dataset="fashion-mnist", model="cnn",
        epochs=args.epochs, eval_every=0.1, progress=False, out_dir=args.out_dir,
        straggler=(f"rank=1,factor={args.factor:g}",) if args.factor > 1 else (), **VARIANTS[strategy],
    )  # fmt: skip
    return ako.train(config).summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--factor", type=float, default=3.0)
    parser.add_argument("--epochs", type=float, default=1.5)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--strategies", default=",".join(VARIANTS))
    parser.add_argument("--out-dir", default="runs/benchmarks")
    args = parser.parse_args()
    results = {s: [run(s, args) for _ in range(args.repeats)] for s in args.strategies.split(",")}
    print(f"{args.workers} workers, cnn on Fashion-MNIST, rank 1 slowed x{args.factor:g}, median of {args.repeats}")
    print(f"{'strategy':<10} {'TTA 85% (s)':>12} {'vs bsp':>7} {'iterations':>11} {'samples/s':>10}  settings")
    tta = {s: _median_tta(runs) for s, runs in results.items()}
    for s, runs in results.items():
        ratio = tta.get("bsp") / tta[s] if tta.get("bsp") and tta[s] else None
        print(
            f"{s:<10} {_text(tta[s]):>12} {'-' if ratio is None else f'{ratio:.2f}x':>7} "
            f"{statistics.median(r['iterations'] for r in runs):>11.0f} "
            f"{statistics.median(r['samples_per_second'] for r in runs):>10.0f}  {VARIANTS[s] or ''}"
        )


def _median_tta(runs) -> float | None:
    times = [r["time_to_accuracy"]["0.85"] for r in runs]
    return statistics.median(times) if None not in times else None


def _text(seconds: float | None) -> str:
    return "not reached" if seconds is None else f"{seconds:.1f}"


if __name__ == "__main__":
    main()
