"""Every strategy on the language model, side by side in one run: the gpt on Debian's fortunes,
4 workers on loopback, AdamW (lr 3e-3, 20 warm-up steps, cosine over the run), batch 16 a
worker (1 epoch = 283 steps): time to a validation loss (rank 0's replica, and the replicas'
average where they differ), its ratio to allreduce's, the loss at the end, and tokens/s.

    .venv/bin/python benchmarks/lm_strategies.py [--target 2.2] [--epochs 1.6] [--seeds 0,1,2]
        [--strategies allreduce,ako,gossip,bsp,ssp,asp,absp,easgd]

A strategy may be `ako:deltas` for Ako with --update deltas. Evaluations are of snapshots
every sixteenth of an epoch, evaluated after training; time is training seconds (rank 0's
clock). With several seeds each cell is the median over them, and "vs allreduce" the median
of each seed's ratio to allreduce's time with that seed (allreduce first in --strategies).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import ako

STRATEGIES = "allreduce,ako,gossip,bsp,ssp,asp,absp,easgd"
RECIPE = dict(dataset="fortunes", model="gpt", batch_size=16, optimizer="adamw", lr=3e-3, warmup="20",
              lr_schedule="cosine", eval_every=0.0625, progress=False)  # fmt: skip


def run(spec: str, seed: int, args) -> tuple[dict, list[dict]]:
    strategy, _, update = spec.partition(":")
    options = {"update": update} if update else {}
    config = ako.TrainConfig(strategy=strategy, workers=args.workers, epochs=args.epochs, seed=seed,
                             out_dir=args.out_dir, **RECIPE, **options)  # fmt: skip
    summary = ako.train(config).summary
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    return summary, [json.loads(line) for line in lines]


def time_to(records: list[dict], key: str, target: float) -> float | None:
    return next((r["time"] for r in records if r.get(key) is not None and r[key] <= target), None)


def shown(times: list[float | None]) -> str:
    """The median time, or how many runs did not reach the target."""
    missed = sum(t is None for t in times)
    return f"not reached by {missed} of {len(times)}" if missed else f"{statistics.median(times):.1f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default=STRATEGIES)
    parser.add_argument("--target", type=float, default=2.2, help="validation loss, nats per character")
    parser.add_argument("--epochs", type=float, default=1.6)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seeds", default="0", help="comma-separated seeds; medians over them")
    parser.add_argument("--out-dir", default="runs/benchmarks/lm")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"| strategy | time to loss <= {args.target} (rank 0) | vs allreduce | replicas' average | "
          f"loss after {args.epochs:g} epoch(s) | training s | tokens/s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    reference, spread = None, []
    for spec in args.strategies.split(","):
        runs = [run(spec, seed, args) for seed in seeds]
        own = [time_to(records, "test_loss", args.target) for _, records in runs]
        average = [time_to(records, "average_loss", args.target) for _, records in runs]
        if spec == "allreduce":
            reference = own
        ratios = [a / b for a, b in zip(own, reference or []) if a is not None and b]
        ratio = f"{statistics.median(ratios):.2f}x" if reference and len(ratios) == len(own) else "-"
        differ = "average_loss" in runs[0][1][-1]
        loss = statistics.median(s["test_loss"] for s, _ in runs)
        seconds = statistics.median(s["train_seconds"] for s, _ in runs)
        tokens = statistics.median(s["tokens_per_second"] for s, _ in runs)
        print(f"| `{spec}` | {shown(own)} | {ratio} | {shown(average) if differ else '-'} | {loss:.3f} | {seconds:.0f} | "
              f"{tokens:.0f} |", flush=True)  # fmt: skip
        spread.append(f"{spec}: " + ", ".join("-" if t is None else f"{t:.1f}" for t in own))
    print(f"\neach seed's time to {args.target:g} (s; seeds {args.seeds}):", *spread, sep="\n  ")


if __name__ == "__main__":
    main()
